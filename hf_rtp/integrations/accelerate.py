"""accelerate on a rotated model: `hf_rtp.Accelerator`, a drop-in subclass of accelerate's, and a plain
`accelerate.Accelerator` adopted when its `prepare` wraps a rotated model (`adopt_caller`).

accelerate saves from the main process, pickling or safetensors-writing each state dict whole: on
rotated parameters that is rank 0's rows (pickling refuses, see distributed.tensors.rotated.RotationMesh). This subclass
keeps everything accelerate saves and loads (schedulers, RNG, dataloaders, custom objects,
non-rotated models) and takes the rotated models and their optimizers out of its hands: every rank
writes and reads them through torch.distributed.checkpoint in `<dir>/hf_rtp_state_<i>`, which also
reshards to another world size. save_model writes the gathered standard checkpoint.

It also defaults `cpu=True` on a machine without CUDA, where accelerate would otherwise run a
multi-process launch undistributed, and fails clearly when accelerate's processes and the rotated
model's ranks disagree.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import types
from contextlib import contextmanager

import accelerate
import torch
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from .. import log
from ..errors import IntegrationError, SettingError, TopologyError
from ..model.context import check_cp_size, sharded
from ..model.state import is_rotated, rotated_module, state_of
from ..private.accelerate_names import (
    forget_prepared,
    on_the_ring,
    prepare_context_parallel,
    prepared,
    set_prepared,
    state_exists,
)
from ..settings import collective_timeout
from ..training_state import load_training_state, save_training_state

STATE_DIR = "hf_rtp_state_{}"


ACCELERATE_FIX = (
    "build Accelerator(cpu=True) (hf_rtp.Accelerator does) and launch with torchrun or `accelerate launch "
    "--multi_gpu --num_processes N`; or, leaving the script as it is, launch it with `ACCELERATE_USE_CPU=true "
    "torchrun --nproc_per_node N` (accelerate's own launcher does not start a plain Accelerator on several CPU "
    "processes)"
)


def check_processes(num_processes: int, world_size: int, what: str = "accelerate", fix: str = ACCELERATE_FIX) -> None:
    if num_processes != world_size:
        raise TopologyError(
            f"{what} runs {num_processes} process(es) but the rotated model spans {world_size} ranks, so every rank "
            f"would train on the same batches. On a machine without CUDA {fix}."
        )


def check_accelerate_state(world_size: int) -> None:
    """from_pretrained after an Accelerator (or TrainingArguments, which builds accelerate's state) was built: its
    state must see every rank. The fix is named in the caller's words: a script that uses TrainingArguments passes
    `use_cpu=True` there (it cannot pass `Accelerator(cpu=True)`); an accelerate loop builds `Accelerator(cpu=True)`."""
    from accelerate.state import PartialState

    if world_size > 1 and state_exists():
        processes = PartialState().num_processes
        if processes != world_size and _training_arguments_exist():
            fix = "pass TrainingArguments(use_cpu=True) (--use_cpu on an example script's command line)"
            fix += " and launch with torchrun --nproc_per_node N"
            check_processes(processes, world_size, "TrainingArguments' accelerate state", fix)
        check_processes(processes, world_size)


def _training_arguments_exist() -> bool:
    """Whether this process holds a TrainingArguments (which builds accelerate's state): only asked on the way to
    an error, so a walk over the garbage collector's objects is affordable."""
    module = sys.modules.get("transformers.training_args")
    cls = getattr(module, "TrainingArguments", None)
    return cls is not None and any(isinstance(o, cls) for o in gc.get_objects())


class Accelerator(accelerate.Accelerator):
    """accelerate's Accelerator for rotated models: their state saved and loaded whole, hf_rtp's timeout on
    accelerate's waits, and `ParallelismConfig(cp_size=N)` as context parallelism on the model's ring (on the
    CPU too, where accelerate refuses any ParallelismConfig): `maybe_context_parallel` cuts the buffers and
    runs the ring attention (model/context/), where accelerate's would do nothing for a model not under FSDP2."""

    def __init__(self, *args, cpu: bool | None = None, kwargs_handlers=None, parallelism_config=None, **kwargs):
        handlers = list(kwargs_handlers or [])
        if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
            # accelerate's own waits (wait_for_everyone, DDP's all-reduce, gather) run on the world
            # group it creates, 30 minutes by default: give them hf_rtp's timeout, so a stopped rank
            # ends the run within HF_RTP_TIMEOUT wherever the others wait for it
            handlers.append(InitProcessGroupKwargs(timeout=collective_timeout()))
        if parallelism_config is not None:
            refuse_other_dimensions(parallelism_config)
            parallelism_config = on_the_ring(parallelism_config)
        super().__init__(
            *args,
            cpu=not torch.cuda.is_available() if cpu is None else cpu,
            kwargs_handlers=handlers,
            parallelism_config=parallelism_config,
            **kwargs,
        )
        self.__dict__[_ADOPTED] = True

    def _prepare_cp(self, *args):
        # torch's context_parallel (accelerate's backend) runs CUDA SDPA under FSDP2; a rotated model's is the ring's
        rotated = [a for a in args if isinstance(a, torch.nn.Module) and is_rotated(a)]
        if not rotated:
            return prepare_context_parallel(self, args)
        for model in rotated:
            check_cp_size(self.parallelism_config.cp_size, state_of(model).topology.ring.size)
        return args

    @contextmanager
    def maybe_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        with maybe_context_parallel(self, buffers, buffer_seq_dims, no_restore_buffers):
            yield

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        state = state_of(model, required=False)
        if state is not None:
            check_processes(self.num_processes, state.topology.world_size)
        if type(self).prepare_model is Accelerator.prepare_model:  # not a subclass's own, which calls this one
            return _prepare_model(self, model, device_placement, evaluation_mode)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    # accelerate's prepare under FSDP2, DeepSpeed or Megatron-LM, which never call prepare_model: refused for a
    # rotated model by name (_SHARDED_AGAIN)
    def _prepare_fsdp2(self, *args):
        return _refusing("_prepare_fsdp2")(self, *args)

    def _prepare_deepspeed(self, *args):
        return _refusing("_prepare_deepspeed")(self, *args)

    def _prepare_megatron_lm(self, *args):
        return _refusing("_prepare_megatron_lm")(self, *args)

    def save_state(self, output_dir=None, safe_serialization: bool = True, **save_model_func_kwargs):
        return save_state(self, output_dir, safe_serialization, **save_model_func_kwargs)

    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        return load_state(self, input_dir, load_kwargs, **load_model_func_kwargs)

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True):
        return save_model(self, model, save_directory, max_shard_size, safe_serialization)


_ADOPTED = "_hf_rtp_adopted"
_REPLACED = ("save_state", "load_state", "save_model", "maybe_context_parallel")


def refuse_other_dimensions(config) -> None:
    """What a ParallelismConfig asks that a rotated model does not do: TP and SP have their own groups and layouts,
    and hf_rtp's ring already holds 1/N of the model. Beside cp_size, accelerate accepts only dp_shard_size (it
    refuses cp with dp_replicate_size): on a rotated model those are rings side by side, each its own data
    (hf_rtp.from_pretrained(..., rtp_size=cp_size)), not FSDP shards; each rank holds 1/cp_size of the model."""
    asked = {n: getattr(config, n, 1) for n in ("tp_size", "sp_size")}
    other = {n: v for n, v in asked.items() if v not in (None, 1)}
    if other:
        raise SettingError(
            "hf_rtp.Accelerator takes ParallelismConfig(cp_size=..., dp_shard_size=...) only: "
            + ", ".join(f"{n}={v}" for n, v in other.items())
            + " shards the model another way, where the ring already holds 1/N of it"
        )
    if getattr(config, "cp_size", 1) > 1 and (getattr(config, "dp_shard_size", 1) or 1) > 1:
        log.info(
            f"ParallelismConfig(cp_size={config.cp_size}, dp_shard_size={config.dp_shard_size}) on rotated models: "
            f"{config.dp_shard_size} rings of {config.cp_size} ranks, each its own sequences, each rank "
            f"1/{config.cp_size} of the model (the ring's rows, not FSDP shards)"
        )


@contextmanager
def maybe_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
    """accelerate's `maybe_context_parallel`, on the rotated model this accelerator prepared: the ring's."""
    config = self.parallelism_config
    model = next((m for m in prepared(self)[0] if is_rotated(m)), None)
    if model is None or config is None or not config.cp_enabled:
        with accelerate.Accelerator.maybe_context_parallel(self, buffers, buffer_seq_dims, no_restore_buffers):
            yield
        return
    with sharded(model, buffers or [], buffer_seq_dims or [], no_restore_buffers, cp_size=config.cp_size):
        yield


def adopt_caller(model) -> None:
    """A plain `accelerate.Accelerator` whose `prepare` is wrapping this rotated model in DDP (DDP reads the names
    it must ignore, model/data_parallel.py, which calls this) gets hf_rtp.Accelerator's save_state, load_state and
    save_model, on that instance only: accelerate's own would pickle rank 0's rows of the model and its optimizer
    (refused, RotatedStateError). A script that builds `accelerate.Accelerator()` then needs no change beyond its
    model load. Its `prepare` does not move a model holding DTensors (`model_has_dtensor`), so DDP's read is the one
    step of `prepare` that hf_rtp sees."""
    accelerator = _preparing_accelerator(depth=12)
    if accelerator is not None:
        adopt(accelerator, model)


def adopt(accelerator, model) -> None:
    """hf_rtp.Accelerator's save_state, load_state, save_model and maybe_context_parallel on this instance of a
    plain `accelerate.Accelerator` that prepares the rotated `model` for training (`adopt_caller`)."""
    if accelerator.__dict__.get(_ADOPTED):
        return
    state = state_of(model, required=False)
    if state is not None:
        check_processes(accelerator.num_processes, state.topology.world_size)
    # a subclass's own save_state (say) stays in charge: replacing it on the instance would skip the user's code
    # without a word; it calls accelerate's, which refuses to pickle rank 0's rows (RotatedStateError)
    own = [n for n in _REPLACED if getattr(type(accelerator), n) is not getattr(accelerate.Accelerator, n)]
    for name in _REPLACED:
        if name not in own:
            setattr(accelerator, name, types.MethodType(globals()[name], accelerator))
    accelerator.__dict__[_ADOPTED] = True
    if own:
        consequence = {
            "maybe_context_parallel": "maybe_context_parallel: does nothing for a model that is not under FSDP2",
        }
        log.warning(
            f"{type(accelerator).__name__} overrides {', '.join(own)}, which hf_rtp leaves in charge: on the rotated "
            "model accelerate's own (which an override calls) "
            + "; ".join(consequence.get(n, f"{n}: refuses to save rank 0's rows") for n in own)
            + ". Subclass hf_rtp.Accelerator instead to keep your override and run the rotated model's"
        )


_SHARDING_TYPES = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def adopt_built_accelerators() -> None:
    """A plain `accelerate.Accelerator` built before a rotated model is loaded (run_clm_no_trainer.py builds it
    first), on accelerator devices: its `prepare` would refuse the model (`_wraps_ddp_on_devices`), or under FSDP,
    DeepSpeed or Megatron-LM shard it again (hf_rtp's prepare refuses those by name), so it gets
    hf_rtp's `prepare_model` now, on that instance only (`adopt_for_trainer`). One walk over the collector's
    objects per load, only where an Accelerator's state exists; one built after the load is refused by accelerate
    itself on GPUs (docs/integrations.md: build it first, or build hf_rtp.Accelerator)."""
    if not state_exists():
        return
    for accelerator in [o for o in gc.get_objects() if issubclass(type(o), accelerate.Accelerator)]:
        try:
            # on devices accelerate would refuse the model; under FSDP it would shard it again (_FSDP_REFUSED)
            wanted = _wraps_ddp_on_devices(accelerator) or accelerator.distributed_type in _SHARDING_TYPES
        except AttributeError:  # one whose shared state was reset since (a finished Trainer's): it prepares nothing
            continue
        if wanted:
            adopt_for_trainer(accelerator)


def adopt_for_trainer(accelerator) -> None:
    """A Trainer's plain accelerator, when the Trainer is attached, before any `prepare`: an evaluate() before
    train() prepares the model for evaluation only, wrapping nothing, so `adopt_caller` (at DDP's wrap) has not run.
    It gets hf_rtp's `maybe_context_parallel` (accelerate's own would run torch's context parallelism on a rotated
    model) and `prepare_model` (`_prepare_model`: the prepare for training then wraps the model in DDP)."""
    if accelerator.__dict__.get(_ADOPTED):
        return
    replacements = [("maybe_context_parallel", maybe_context_parallel), ("prepare_model", _prepare_model)]
    replacements += [(name, _refusing(name)) for name in _OTHER_SHARDERS if hasattr(accelerate.Accelerator, name)]
    for name, replacement in replacements:
        if name not in accelerator.__dict__ and getattr(type(accelerator), name) is getattr(
            accelerate.Accelerator, name
        ):
            setattr(accelerator, name, types.MethodType(replacement, accelerator))


_SHARDED_AGAIN = (
    "accelerate is set up for {what}, which would shard the rotated model's parameters again: they are RTP's rows "
    "already, each rank holding 1/N of every weight. Train a rotated model without it (as under DDP: each rank on "
    "its own data). For {offload}, the optimizer's state and step in host memory, build "
    "hf_rtp.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=...) and pass it to prepare (Trainer: "
    "optimizers=(it, None)); docs/integrations.md"
)
_FSDP = ("FSDP (an fsdp_config, Trainer's --fsdp, ACCELERATE_USE_FSDP)", "FSDP's cpu_offload (CPUOffloadPolicy)")
_FSDP_REFUSED = _SHARDED_AGAIN.format(what=_FSDP[0], offload=_FSDP[1])
# accelerate's prepare hands every object at once to these instead of prepare_model: each is refused for a rotated one
_OTHER_SHARDERS = {
    "_prepare_fsdp2": _FSDP,
    "_prepare_deepspeed": (
        "DeepSpeed (a deepspeed_config, Trainer's --deepspeed, ACCELERATE_USE_DEEPSPEED)",
        "ZeRO-Offload (offload_optimizer)",
    ),
    "_prepare_megatron_lm": ("Megatron-LM (a megatron_lm_config)", "optimizer offload"),
}


def _refusing(name: str):
    def prepare(self, *args):
        if any(isinstance(a, torch.nn.Module) and is_rotated(a) for a in args):
            what, offload = _OTHER_SHARDERS[name]
            raise IntegrationError(_SHARDED_AGAIN.format(what=what, offload=offload))
        return getattr(accelerate.Accelerator, name)(self, *args)

    prepare.__name__ = name
    return prepare


def _prepare_model(self, model, device_placement=None, evaluation_mode=False):
    """accelerate's prepare_model, where an evaluation-mode prepare of a rotated model leaves it unmarked. accelerate
    1.15 marks every prepared model and returns a marked one as it is: after Trainer's evaluate() (evaluation mode,
    no DDP) its train() would never wrap the model in DDP, and each rank would step the replicated parameters on
    its own gradients (vanilla models too; for a rotated one hf_rtp's step check refuses it: model/data_parallel.py).
    The prepare for training then wraps it in DDP, replacing its evaluation-mode entry."""
    if state_of(model, required=False) is None:
        return accelerate.Accelerator.prepare_model(self, model, device_placement, evaluation_mode)
    if self.distributed_type == DistributedType.FSDP:
        raise IntegrationError(_FSDP_REFUSED)
    if not evaluation_mode:
        models, optimizers = prepared(self)
        set_prepared(self, [m for m in models if m is not model], optimizers)
        if _wraps_ddp_on_devices(self):
            return _prepare_on_devices(self, model, device_placement)
    result = accelerate.Accelerator.prepare_model(self, model, device_placement, evaluation_mode)
    if evaluation_mode and result is model:
        forget_prepared(model)
    return result


def _wraps_ddp_on_devices(accelerator) -> bool:
    """Whether accelerate's `prepare_model` wraps a model for training in DDP on accelerator devices (CUDA, XPU,
    ...): there accelerate 1.15 refuses any model holding DTensors first (`model_has_dtensor`: "incompatible with
    DDP. Maybe you loaded your model with device_map='auto'?"), a guard for DTensors that DDP would broadcast and
    all-reduce as plain tensors. A rotated model's DTensors are the ones DDP ignores (model/data_parallel.py). On
    the CPU (MULTI_CPU) accelerate wraps without that guard."""
    config = accelerator.parallelism_config
    return bool(accelerator.multi_device) and not (config is not None and config.tp_enabled)


def _prepare_on_devices(self, model, device_placement):
    """accelerate's prepare for training on accelerator devices, on a rotated model: its evaluation-mode prepare
    (mixed precision's autocast on forward, device placement, as the training prepare applies them), then the
    DDP wrap as accelerate's own multi-device branch makes it (its DDP kwargs handler and comm hook, one device per
    process), which reads the rotated parameters DDP must leave alone. Called for every Accelerator hf_rtp adopts:
    hf_rtp.Accelerator, a Trainer's (TRL's too), and a plain one built before the model was loaded."""
    adopt(self, model)
    result = accelerate.Accelerator.prepare_model(self, model, device_placement, evaluation_mode=True)
    if result is not model:  # torch.compile or an fp8 wrapper, which accelerate applies around DDP, not inside it
        raise IntegrationError(
            f"accelerate wrapped the rotated model in {type(result).__name__} before DDP; hf_rtp's rotated layers "
            "run without torch.compile and fp8 wrappers: remove the Accelerator's dynamo or fp8 setting"
        )
    forget_prepared(model)  # accelerate marks what it returns: here the DDP wrapper, as its training prepare does
    if any(p.requires_grad for p in model.parameters()):
        kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        if os.environ.get("ACCELERATE_BYPASS_DEVICE_MAP", "false") == "true":
            device_ids, output_device = None, None
        elif self.device.type == "hpu":
            device_ids, output_device = [self.device.index], self.device.index
        else:
            device_ids, output_device = [self.local_process_index], self.local_process_index
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=device_ids, output_device=output_device, **kwargs
        )
        if self.ddp_handler is not None:
            self.ddp_handler.register_comm_hook(model)
    model._is_accelerate_prepared = True
    return model


def _preparing_accelerator(depth: int):
    """The accelerate.Accelerator whose `prepare_model` is on the stack within `depth` frames, if any."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == "prepare_model":
            owner = frame.f_locals.get("self")
            if isinstance(owner, accelerate.Accelerator):
                return owner
        frame = frame.f_back
    return None


def save_state(self, output_dir=None, safe_serialization: bool = True, **save_model_func_kwargs):
    """accelerate's save_state without the rotated models and their optimizers, which every rank writes to
    `<location>/hf_rtp_state_<i>` through torch.distributed.checkpoint."""
    pairs = _rotated_pairs(self)
    with _without(self, pairs):
        location = accelerate.Accelerator.save_state(
            self, output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs
        )
    for i, (model, optimizer) in enumerate(pairs):
        save_training_state(os.path.join(location, STATE_DIR.format(i)), model, optimizer.optimizer)
    return location


def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
    pairs = _rotated_pairs(self)
    input_dir = input_dir if input_dir is not None else _latest_checkpoint(self)
    with _without(self, pairs):
        accelerate.Accelerator.load_state(self, input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)
    for i, (model, optimizer) in enumerate(pairs):
        load_training_state(os.path.join(input_dir, STATE_DIR.format(i)), model, optimizer.optimizer)


def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True):
    base = rotated_module(model)
    if base is None:
        return accelerate.Accelerator.save_model(self, model, save_directory, max_shard_size, safe_serialization)
    if base is not self.unwrap_model(model):
        raise IntegrationError(
            "save_model of a PEFT model on a rotated base would write the whole base from one rank: save the "
            "adapters with model.save_pretrained(dir) on the main process, or merge them first"
        )
    base.save_pretrained(save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization)


def _rotated_pairs(self) -> list[tuple]:
    """(unwrapped model, its AcceleratedOptimizer) for every prepared rotated model, in preparation order."""
    pairs = []
    models, optimizers = prepared(self)
    for model in models:
        if rotated_module(model) is None:
            continue
        params = {id(p) for p in model.parameters()}
        owners = [o for o in optimizers if any(id(p) in params for g in o.param_groups for p in g["params"])]
        if len(owners) != 1:
            raise IntegrationError(
                f"save_state/load_state need exactly one prepared optimizer per rotated model, found {len(owners)}"
            )
        pairs.append((self.unwrap_model(model), owners[0]))
    return pairs


@contextmanager
def _without(self, pairs):
    """Hide rotated models and their optimizers from accelerate's main-process save and load."""
    models, optimizers = prepared(self)
    inner = {id(o) for _, o in pairs}
    rotated = [m for m in models if rotated_module(m) is not None]
    set_prepared(self, [m for m in models if m not in rotated], [o for o in optimizers if id(o) not in inner])
    try:
        yield
    finally:
        set_prepared(self, models, optimizers)


def _latest_checkpoint(self) -> str:
    """The folder accelerate's load_state picks when given none (automatic checkpoint naming)."""
    root = os.path.join(self.project_dir, "checkpoints")
    if not self.project_configuration.automatic_checkpoint_naming or not os.path.isdir(root):
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    folders = sorted(os.listdir(root), key=lambda f: int(re.findall(r"[0-9]+", f)[-1]))
    return os.path.join(root, folders[-1])
