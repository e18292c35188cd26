"""hf_rtp's exceptions are caught where transformers' are: a CheckpointError is an OSError (transformers raises
one for a path that does not exist, or a folder without its config or weights) and a ValueError (AutoModel's
for a folder without config.json). And each class survives the trip between ranks as agreement makes it."""

from __future__ import annotations

import pickle

import pytest
import transformers

import hf_rtp
from hf_rtp.errors import CLASSES, CheckpointError

# what a caller of from_pretrained catches
BUILTIN = (OSError, ValueError, TypeError, RuntimeError)


def test_checkpoint_error_is_an_os_error_and_keeps_its_message():
    assert issubclass(CheckpointError, OSError) and issubclass(CheckpointError, ValueError)
    assert issubclass(CheckpointError, hf_rtp.HfRtpError) and issubclass(CheckpointError, RuntimeError)
    err = CheckpointError("cannot open /x/model.safetensors: Permission denied")
    assert str(err) == "cannot open /x/model.safetensors: Permission denied"
    assert err.args == ("cannot open /x/model.safetensors: Permission denied",)
    assert err.errno is None  # one message, not OSError's (errno, strerror): str is the message as given
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is CheckpointError and str(again) == str(err)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_class_is_raised_again_by_name_with_its_message(name):
    # distributed.ranks.agreement: the failing rank's class name and message travel; the others raise the same
    raised = CLASSES[name](f"rank 1 failed: {CLASSES[name]('no config.json')}")
    assert type(raised).__name__ == name and str(raised) == "rank 1 failed: no config.json"
    assert str(pickle.loads(pickle.dumps(raised))) == str(raised)


def _raised(load, path) -> BaseException:
    with pytest.raises(BUILTIN) as raised:
        load(path)
    return raised.value


def test_except_os_error_catches_a_missing_checkpoint_as_it_does_for_transformers(tmp_path):
    """One process, no launcher: world size 1 needs no process group. Where transformers raises an
    OSError (or a ValueError), hf_rtp's error is one too, so the caller's `except` is the same."""
    no_weights = tmp_path / "no_weights"
    transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(no_weights)
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "does-not-exist", "empty": tmp_path / "empty", "no weights": no_weights}
    vanilla_loads = (transformers.AutoModelForCausalLM.from_pretrained, transformers.LlamaForCausalLM.from_pretrained)
    for what, path in paths.items():
        ours = _raised(hf_rtp.from_pretrained, str(path))
        assert isinstance(ours, CheckpointError), (what, ours)
        for load in vanilla_loads:
            theirs = _raised(load, str(path))
            assert {c for c in BUILTIN if isinstance(theirs, c)} <= {c for c in BUILTIN if isinstance(ours, c)}, (
                what,
                load,
                theirs,
            )
    # the cases users write `except OSError` for, as they do for transformers
    for what in ("missing", "no weights"):
        for load in (*vanilla_loads, hf_rtp.from_pretrained):
            with pytest.raises(OSError):
                load(str(paths[what]))
