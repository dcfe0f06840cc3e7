"""The FSDP2 engine as the loop's `Trainable`: `fully_shard` units, fused AdamW on DTensors.

`fsdp_version: 2` picks it (`make_trainable`). The wrap policy (`fsdp_config`) chooses the
units (`protrain.distributed.fsdp2`); parameters compute in bf16 where the run's mixed
precision is bf16 (fp32 otherwise) and gradients are reduced in fp32, SUMMED over ranks
(each rank's loss is already divided by the tokens of the whole global batch). Every
micro-batch's backward reduce-scatters its gradients, which accumulate in fp32 shards.

Under `memory:` the FSDP2 engine takes the two options that issue no collective of their
own: `tiled_mlp_tokens` (each block's MLP and norms over sequence tiles, applied after the
units are sharded) and `chunked_loss_tokens` (the head over chunks of tokens inside the
root's forward, see `forward_loss_sum`). Modules whose hooks would run once per tile or
per chunk are never units ([Note: modules that are never units] in
`protrain.distributed.fsdp2.units`), so every rank issues the same collectives whatever its
sequence length. QLoRA's 4-bit base weights are sharded in the computing dtype
([Note: 4-bit weights under FSDP2]).

Checkpoints on several ranks are sharded (`train/checkpoint/sharded.py`): every rank writes
its own dim-0 shards of the trainable parameters and their AdamW moments, named by
parameter (`protrain.distributed.fsdp2.checkpoint`), with no gather, so that the chunked engine,
plain PyTorch or this engine resume them at any world size. On one process the checkpoint
is whole, in `PlainTrainable`'s format: `model_state` and `optimizer_state` gather full
tensors to rank 0's host (collectives), and loading takes a whole state on every rank and
keeps each rank's own shard. The export gathers the whole model to rank 0.

On one process (no `torchrun`) the engine starts a single-rank process group itself and
ends it in `close`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from protrain.activations import apply_tiled_mlp
from protrain.activations.checkpoint import checkpointed_forward
from protrain.activations.forward_wrap import wrap_forward
from protrain.activations.tiled_mlp import find_mlp
from protrain.distributed.agree import alike
from protrain.distributed.fsdp2 import (
    DEFAULT_MIN_NUM_PARAMS,
    SIZE_BASED_WRAP,
    TRANSFORMER_BASED_WRAP,
    FSDP2Settings,
    apply_fsdp2,
    prepare_4bit,
    release_groups,
)
from protrain.distributed.fsdp2.optimizer import FullStateAdamW
from protrain.model import BlockDiscoveryError, discover_blocks
from protrain.train.config import TrainConfig
from protrain.train.errors import ConfigError
from protrain.train.log import logger
from protrain.train.loss import loss_sum, unwrap_causal_lm
from protrain.train.trainable import Trainable, _fused_supported, optimizer_param_groups

FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


class FSDP2Trainable(Trainable):
    """`torch.distributed.fsdp.fully_shard` over the ranks (or one), as `fsdp_config` says."""

    shards_checkpoints = (
        True  # several ranks write sharded checkpoints (distributed/fsdp2/checkpoint.py)
    )

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
    ):
        fsdp = cfg.fsdp
        assert fsdp is not None
        mem = cfg.memory
        self._own_group = _start_single_rank_group(device)
        model.train()
        # FSDP2 casts the parameters itself (MixedPrecisionPolicy): no autocast.
        super().__init__(model, device, None, mem.chunked_loss_tokens)
        param_dtype = torch.bfloat16 if autocast_dtype == torch.bfloat16 else None
        n_4bit = prepare_4bit(model, param_dtype or _float_dtype(model))
        if n_4bit:
            logger.info(
                "fsdp2: %d 4-bit layers, packed weights stored as %s and sharded; their "
                "scales whole on every rank",
                n_4bit,
                param_dtype or _float_dtype(model),
            )
        settings = FSDP2Settings(
            auto_wrap_policy=fsdp.auto_wrap_policy,
            layer_classes=tuple(_layer_classes(model, fsdp.transformer_layer_cls_to_wrap))
            if fsdp.auto_wrap_policy == TRANSFORMER_BASED_WRAP
            else (),
            min_num_params=fsdp.min_num_params or DEFAULT_MIN_NUM_PARAMS,
            reshard_after_forward=fsdp.reshard_after_forward,
            offload_params=fsdp.offload_params,
            param_dtype=param_dtype,
            not_units=frozenset(_not_units(model, mem.chunked_loss_tokens, mem.tiled_mlp_tokens)),
            forward_prefetch=fsdp.forward_prefetch,
            backward_prefetch=fsdp.backward_prefetch != "NO_PREFETCH",
        )
        if fsdp.backward_prefetch == "BACKWARD_POST":
            logger.info(
                "fsdp_config.backward_prefetch = BACKWARD_POST: issued at each unit's "
                "pre-backward, as BACKWARD_PRE (FSDP2 has no post-backward prefetch)"
            )
        elif fsdp.backward_prefetch == "NO_PREFETCH":
            logger.info(
                "fsdp_config.backward_prefetch = NO_PREFETCH: FSDP2's implicit backward "
                "prefetch (reverse post-forward order) stays; fully_shard cannot turn it off"
            )
        if fsdp.auto_wrap_policy == SIZE_BASED_WRAP and fsdp.min_num_params is None:
            logger.info(
                "fsdp_config.min_num_params not set: %d (accelerate's default)",
                DEFAULT_MIN_NUM_PARAMS,
            )
        if fsdp.state_dict_type == "FULL_STATE_DICT" and dist.get_world_size() > 1:
            logger.info(
                "fsdp_config.state_dict_type = FULL_STATE_DICT: checkpoints of several ranks "
                "are written sharded all the same (each rank its own shards, no gather); "
                "`protrain convert-checkpoint` makes a whole one"
            )
        if fsdp.cpu_ram_efficient_loading:
            logger.info(
                "fsdp_config.cpu_ram_efficient_loading: every rank builds the model on its "
                "host; fully_shard moves only the rank's own shard to %s",
                device,
            )
        # rank 0 exports: a copy of the model without its parameters, filled at the end
        # (made while 4-bit scales are still on the host: apply_fsdp2 moves them)
        self._skeleton = _without_parameters(model) if dist.get_rank() == 0 else None
        undo = self._checkpoint_blocks() if fsdp.activation_checkpointing else []
        self._mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        self.units = apply_fsdp2(model, settings, self._mesh)
        if mem.tiled_mlp_tokens is not None:  # after sharding: it checks the MLPs hold no unit
            undo.append(self._tile_mlps(mem.tiled_mlp_tokens))
        self.activations = _Undo(undo) if undo else None
        logger.info(
            "fsdp2: %d ranks, %s, %d units + root%s; param dtype %s, reduce fp32, "
            "offload_params=%s, reshard_after_forward=%s, activation_checkpointing=%s, "
            "explicit prefetch forward=%s backward=%s, tiled_mlp_tokens=%s, "
            "chunked_loss_tokens=%s",
            dist.get_world_size(),
            settings.auto_wrap_policy,
            len(self.units),
            f" (classes {', '.join(settings.layer_classes)})"
            if settings.layer_classes
            else f" (min_num_params {settings.min_num_params})",
            settings.param_dtype or "of the weights",
            settings.offload_params,
            settings.reshard_after_forward,
            fsdp.activation_checkpointing,
            settings.forward_prefetch,
            settings.backward_prefetch,
            mem.tiled_mlp_tokens,
            mem.chunked_loss_tokens,
        )
        # fused AdamW over the DTensor shards (on the host when parameters are offloaded)
        self.optimizer = FullStateAdamW(
            optimizer_param_groups(model, cfg.weight_decay),
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_epsilon,
            fused=_fused_supported(model),
        )
        self._closed = False

    def _checkpoint_blocks(self) -> list[Callable[[], None]]:
        """Recompute each discovered block in backward, whatever the wrap policy; the
        module's names stay as they are (its forward is wrapped, not the module)."""
        try:
            layout = discover_blocks(self.model)
        except BlockDiscoveryError as exc:
            raise ConfigError(f"fsdp_config.activation_checkpointing: {exc}") from None
        return [wrap_forward(block.module, checkpointed_forward) for block in layout.blocks]

    def _tile_mlps(self, tile_tokens: int) -> Callable[[], None]:
        """Each block's MLP and norms over sequence tiles (no collective of their own)."""
        try:
            handle = apply_tiled_mlp(self.model, tile_tokens=tile_tokens)
        except (BlockDiscoveryError, ValueError) as exc:
            raise ConfigError(f"memory.tiled_mlp_tokens = {tile_tokens}: {exc}") from None
        return handle.remove

    def forward_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sum of token losses of one micro-batch. The chunked loss calls the causal-LM body
        and the head itself; it runs as the root's forward, so that FSDP2's root hooks
        gather the root's parameters (embeddings, final norm, head) for it and end the
        backward's reductions, as for the model's own forward."""
        if self.chunked_loss_tokens is None:
            return super().forward_loss_sum(batch)

        def chunked(_forward: Callable) -> Callable:
            return lambda b: loss_sum(self.model, b, self.device, self.chunked_loss_tokens)

        undo = wrap_forward(self.model, chunked)
        try:
            # the batch as an argument: FSDP2's root pre-forward on CUDA indexes the moved
            # arguments and fails on a call with none (IndexError, torch 2.11)
            return self.model(batch)
        finally:
            undo()

    def clip_grad_norm(self, max_norm: float | None) -> float | None:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):  # a partial sum of squares on each rank
            norm = norm.full_tensor()
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return float(norm)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def model_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """Whole trainable parameters on rank 0's host (a collective; other ranks get {})."""
        state = get_model_state_dict(self.model, options=FULL_ON_RANK0)
        return {name: state[name] for name in self.names if name in state}

    def optimizer_state(self, copy: bool = True) -> dict:
        """Whole optimizer state on rank 0's host, keyed by parameter index as
        `torch.optim.Optimizer.state_dict` keys it (a collective; other ranks get none)."""
        full = get_optimizer_state_dict(self.model, self.optimizer, options=FULL_ON_RANK0)
        index: dict[str, int] = {}
        groups = []
        for group in full.get("param_groups", []):
            ids = []
            for fqn in group["params"]:
                index[fqn] = len(index)
                ids.append(index[fqn])
            groups.append({**group, "params": ids})
        state = {index[fqn]: values for fqn, values in full.get("state", {}).items()}
        return {"state": state, "param_groups": groups}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load a whole state that every rank holds; each keeps its own shard."""
        self._check_state_names(state)
        set_model_state_dict(
            self.model, state, options=StateDictOptions(full_state_dict=True, strict=False)
        )

    def export_model(self) -> nn.Module:
        """Rank 0: a plain module with the trained weights (every rank must call this: the
        weights are gathered); other ranks get the sharded model back."""
        state = get_model_state_dict(self.model, options=FULL_ON_RANK0)
        self.remove_activation_policies()
        if self._skeleton is None:
            return self.model
        model, self._skeleton = self._skeleton, None
        model.load_state_dict(state, strict=False, assign=True)
        left = [n for n, p in model.named_parameters() if p.is_meta]
        if left:
            raise RuntimeError(f"fsdp2 export: no weights gathered for {left[:5]}")
        return model

    def full_tensor(self, name: str) -> torch.Tensor:
        """A DTensor's whole value on every rank (one all-gather), else the tensor (itself
        where it is on the host: to be read, not changed)."""
        value = self.model.state_dict(keep_vars=True)[name].detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        return value.to("cpu")

    def own_trainable_values(self) -> dict[str, torch.Tensor]:
        params = dict(self.model.named_parameters())
        return {
            name: p.to_local() if isinstance(p, DTensor) else p
            for name, p in ((n, params[n].detach()) for n in self.names)
        }

    def close(self, keep_weights: bool = True) -> None:
        self.remove_activation_policies()
        if not self._closed:
            self._closed = True
            # DTensor's caches keep the mesh ([Note: the meshes outlive the model])
            release_groups(self._mesh)
            if self._own_group and dist.is_initialized():
                dist.destroy_process_group()


class _Undo:
    """What `remove_activation_policies` takes off: the blocks' checkpointed forwards and
    the tiled MLPs."""

    def __init__(self, undo: list[Callable[[], None]]):
        self.undo = undo

    def remove(self) -> None:
        for undo in self.undo:
            undo()
        self.undo = []


def _not_units(
    model: nn.Module, chunked_loss_tokens: int | None, tiled_mlp_tokens: int | None
) -> set[str]:
    """Modules that must not be FSDP2 units under the chunked loss and the tiled MLP (see
    [Note: modules that are never units] in `protrain.distributed.fsdp2.units`)."""
    names = {id(m): n for n, m in model.named_modules()}
    out: set[str] = set()
    if chunked_loss_tokens is not None:
        lm = unwrap_causal_lm(model)
        path = names[id(lm)]
        parts = path.split(".") if path else []
        # the root's descendants down to the causal LM, whose forwards the loss calls past
        out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
        head = names[id(lm.get_output_embeddings())]
        out.update(n for n in names.values() if n == head or n.startswith(head + "."))
    if tiled_mlp_tokens is not None:
        try:
            blocks = discover_blocks(model).blocks
        except BlockDiscoveryError as exc:
            raise ConfigError(f"memory.tiled_mlp_tokens = {tiled_mlp_tokens}: {exc}") from None
        for block in blocks:
            found = find_mlp(block.module)
            if found is not None:
                mlp = names[id(found[1])]
                out.update(n for n in names.values() if n.startswith(mlp + "."))
    out.discard("")
    return out


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point parameters (4-bit packed weights aside)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def check_layer_classes(model: nn.Module, cfg: TrainConfig) -> None:
    """Refuse, in one line, the units `fsdp_config` names for ``model`` (built on the
    meta device before the data and the weights load) where it lacks them."""
    fsdp = cfg.fsdp
    if fsdp is not None and fsdp.auto_wrap_policy == TRANSFORMER_BASED_WRAP:
        _layer_classes(model, fsdp.transformer_layer_cls_to_wrap)


def _layer_classes(model: nn.Module, listed: list[str] | None) -> list[str]:
    """The class names of TRANSFORMER_BASED_WRAP: as listed, or the discovered blocks'."""
    present = {type(m).__name__ for m in model.modules()}
    if listed:
        missing = [name for name in listed if name not in present]
        if missing:
            try:
                layers = sorted({type(b.module).__name__ for b in discover_blocks(model).blocks})
            except BlockDiscoveryError:
                layers = []
            hint = f"; its layer class: {', '.join(layers)}" if layers else ""
            raise alike(
                ConfigError(
                    f"fsdp_config.transformer_layer_cls_to_wrap = {listed!r} is not allowed: "
                    f"no module of class {', '.join(missing)} in {type(model).__name__}{hint} "
                    "(or leave the key out: the discovered layers are the units)"
                )
            )
        return list(listed)

    try:
        layout = discover_blocks(model)
    except BlockDiscoveryError as exc:
        raise alike(
            ConfigError(
                f"fsdp_config.transformer_layer_cls_to_wrap is not set and {exc}: name the layer "
                "classes, or use auto_wrap_policy = SIZE_BASED_WRAP"
            )
        ) from None
    return sorted({type(b.module).__name__ for b in layout.blocks})


def _without_parameters(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters are on the meta device (ties kept);
    buffers are copied."""
    memo = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in model.parameters()
    }
    return copy.deepcopy(model, memo)


def _start_single_rank_group(device: torch.device) -> bool:
    """One process: a process group of one rank for FSDP2 (True where started here)."""
    if dist.is_initialized():
        return False
    if device.type == "cuda":
        # torch 2.11's set_device refuses a bare "cuda" (no index); 2.13 takes it
        torch.cuda.set_device(torch.cuda.current_device() if device.index is None else device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    logger.info("fsdp2 on one process: a process group of one rank (%s)", backend)
    return True
