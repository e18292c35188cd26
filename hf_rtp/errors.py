"""Every exception hf_rtp raises on purpose. A failure on one rank is raised as the same class on
every rank (see distributed.ranks.agreement), so `except hf_rtp.CheckpointError` works alike everywhere."""

from __future__ import annotations


class HfRtpError(RuntimeError):
    """Base class of hf_rtp's errors."""


class CheckpointError(HfRtpError, ValueError, OSError):
    """A checkpoint is missing, unreadable, or disagrees with its config. An OSError too, as transformers'
    from_pretrained raises for a path that does not exist or a folder without its config or weights, so
    `except OSError` keeps working (and `except ValueError`, for the folder AutoModel finds no config in)."""


class PlanError(HfRtpError, ValueError):
    """A plan does not fit the model it is applied to."""


class UnsupportedModelError(PlanError):
    """No plan is registered for this model_type."""


class TopologyError(HfRtpError):
    """The launch environment, the process group, the mesh or the accelerator disagree."""


class CollectiveMisuseError(HfRtpError):
    """A call every rank must make (forward, generate, save) was not made by every rank."""


class UnsyncedGradientsError(CollectiveMisuseError):
    """An optimizer step over replicated parameters whose gradients no rank averaged over the others
    (`hf_rtp.sync_grads`, DDP or `accelerator.prepare`): each rank would step them on its own batch alone."""


class RotatedStateError(HfRtpError):
    """A path would treat rotated parameters as ordinary SPMD DTensors: every rank holds other data,
    so a rank-0 slice, a pickled shard or a slice-only gradient would be silently wrong."""


class IntegrationError(HfRtpError):
    """accelerate, Trainer, TRL or PEFT are used in a way hf_rtp cannot make data-parallel correct."""


class KeywordError(HfRtpError, TypeError):
    """A keyword, argument or config hf_rtp does not take (or not with this value), refused by name. A TypeError
    too, as transformers raises for an argument it does not take, so `except TypeError` keeps working."""


class SettingError(HfRtpError, ValueError):
    """A value hf_rtp cannot use (a dtype, a size, a timeout, a fault point). A ValueError too, as transformers
    raises for a bad value."""


CLASSES = {
    cls.__name__: cls
    for cls in (
        HfRtpError,
        CheckpointError,
        PlanError,
        UnsupportedModelError,
        TopologyError,
        CollectiveMisuseError,
        UnsyncedGradientsError,
        RotatedStateError,
        IntegrationError,
        KeywordError,
        SettingError,
    )
}
