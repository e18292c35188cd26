"""hf_rtp never imports PEFT itself: PEFT imports bitsandbytes when it is installed (about 2 s and 45 MB per
process that uses neither). A rotated load installs the PEFT stand-ins at once when PEFT is imported, else
leaves a one-shot finder that installs them right after the script's own `import peft` (the usual order in
a notebook: load, then import PEFT). A fresh interpreter, since this process has PEFT imported already;
recipes/finetune.py --load_in_4bit (tests/e2e) runs the same order on two ranks, LoRA on the rotated base."""

import json
import subprocess
import sys

SCRIPT = """
import importlib.util, json, sys
import hf_rtp
from hf_rtp.integrations.peft import install_when_peft_is_imported

install_when_peft_is_imported()  # what a rotated from_pretrained calls
# what loading any vanilla model (a reward or reference model) asks: a lookup that imports nothing
from transformers.utils import is_peft_available
assert is_peft_available()
importlib.util.find_spec("peft")
imported = sorted(m for m in ("peft", "bitsandbytes") if m in sys.modules)
waiting = [type(f).__name__ for f in sys.meta_path if type(f).__module__ == "hf_rtp.integrations.peft"]
import peft.tuners.tuners_utils as tuners_utils

stand_in = getattr(tuners_utils._get_in_out_features, "hf_rtp_stands_in_for", None)
left = [type(f).__name__ for f in sys.meta_path if type(f).__module__ == "hf_rtp.integrations.peft"]
print(json.dumps([imported, waiting, stand_in, left]))
"""


def test_peft_imported_after_a_rotated_load_gets_the_stand_ins_at_its_import():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    imported, waiting, stand_in, left = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == []  # neither PEFT nor bitsandbytes came with hf_rtp
    assert waiting == ["_WhenImported"]  # one finder, until PEFT is imported
    assert stand_in == "peft.tuners.tuners_utils._get_in_out_features"  # installed right after the import
    assert left == []  # and the finder is gone
