"""The optimizer choice, and bitsandbytes' 8-bit AdamW for the chunks updated on the device.

``optimizer="adamw"`` (the default) keeps two fp32 moments per trainable parameter;
``optimizer="adamw_8bit"`` keeps the moments of the *persistent* chunks (stepped on the
device) as bitsandbytes' blockwise 8-bit state: per tensor ``state1`` and ``state2`` (one
uint8 an element), ``absmax1`` and ``absmax2`` (one fp32 per block of 256 elements) and the
two 256-entry quantization maps ``qmap1``/``qmap2`` (shared by every tensor). Masters stay
fp32; the update is bitsandbytes' own (``bnb.optim.AdamW8bit.update_step``, which calls
``bnb.functional.optimizer_update_8bit_blockwise``), so the result equals
``bnb.optim.AdamW8bit`` stepping the fp32 masters. As there, a tensor of fewer than
``MIN_8BIT_SIZE`` elements keeps fp32 state (``optimizer_update_32bit``).

[Note: 8-bit state on the host]
Offloaded chunks keep fp32 moments on the host, stepped by torch's fused AdamW
(``optim/flat_adamw.py``), with either choice; so do the device-stepped offloaded chunks,
whose moments are the host's (``optim/device_step.py``). bitsandbytes' CPU update
dequantizes both moments to fp32 temporaries, steps them and quantizes them back, and
measured 20x slower than the fused AdamW the host runs: 0.814 s against 0.040 s for one
step of 33.5 M parameters as one flat tensor (41 against 839 M parameters/s, 2 threads,
bitsandbytes 0.50.2, torch's fused CPU AdamW). The host AdamW overlaps the next forward
only while it is fast, so the planner could not use it; 8-bit state is where it saves the
memory that bounds the plan, on the device.
"""

from __future__ import annotations

import torch

from protrain.optim.state_format import check_saved_format

OPTIMIZERS = ("adamw", "adamw_8bit")
MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller tensors keep fp32 state
BLOCK = 256  # elements per absmax of the blockwise state
QMAP_BYTES = 2 * 256 * 4  # the two fp32 quantization maps, shared by every tensor
STATE_KEYS_8BIT = {"step", "state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2"}
STATE_KEYS_32BIT = {"step", "state1", "state2"}  # bitsandbytes' state of a small tensor
TORCH_STATE_KEYS = {"step", "exp_avg", "exp_avg_sq"}
QMAP_KEYS = ("qmap1", "qmap2")


def check_optimizer(optimizer: str, world_size: int = 1) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(
            f"optimizer={optimizer!r} is not allowed: use one of {', '.join(map(repr, OPTIMIZERS))}"
        )
    if optimizer == "adamw_8bit" and world_size > 1:
        # the sharded checkpoint format splits each tensor of a parameter's state by the
        # parameter's elements, which bitsandbytes' per-block scales and maps are not
        raise ValueError(
            f"optimizer='adamw_8bit' with several ranks ({world_size}) is not supported: its "
            "8-bit state does not split into the sharded checkpoints of several ranks; use "
            "optimizer='adamw' with several ranks, or one rank for 'adamw_8bit'"
        )


def state_bytes_8bit(numel: int) -> int:
    """Device bytes of bitsandbytes' AdamW8bit state of one tensor (the shared maps aside)."""
    if numel < MIN_8BIT_SIZE:
        return 8 * numel  # two fp32 moments
    return 2 * numel + 8 * (-(-numel // BLOCK))


def device_adamw(groups: list[dict], optimizer: str) -> torch.optim.Optimizer:
    """The optimizer of the persistent chunks' fp32 masters: torch's fused AdamW, or
    bitsandbytes' 8-bit AdamW (:class:`DeviceAdamW8bit`)."""
    if optimizer == "adamw_8bit":
        return DeviceAdamW8bit(groups)
    return torch.optim.AdamW(groups, fused=True)


def device_state_keys(optimizer: str, numel: int) -> set[str]:
    """The keys of one parameter's state in :func:`device_adamw`'s optimizer."""
    if optimizer == "adamw_8bit":
        return STATE_KEYS_8BIT if numel >= MIN_8BIT_SIZE else STATE_KEYS_32BIT
    return TORCH_STATE_KEYS


def convert_state(st: dict, want: set[str], device_opt=None) -> dict:
    """One parameter's saved AdamW state in the format ``want`` (a key set above), where a
    new plan moved the parameter between the device (8-bit state) and the host (fp32
    moments) under the same ``optimizer`` choice: the moments are dequantized with
    bitsandbytes' own blockwise code (exact to its 8-bit values), or quantized as its
    AdamW8bit quantizes them (blocks of 256, its signed map for the first moment and unsigned
    map for the second; ``device_opt``: the :class:`DeviceAdamW8bit` whose maps to use).
    The step count is kept."""
    have = set(st)
    if have == want:
        return st
    step = st["step"]
    count = float(step.item() if torch.is_tensor(step) else step)
    if have == STATE_KEYS_8BIT:
        F = import_bitsandbytes().functional
        m, v = (
            F.dequantize_blockwise(st[f"state{i}"], absmax=st[f"absmax{i}"], code=st[f"qmap{i}"],
                                   blocksize=BLOCK).float()
            for i in (1, 2)
        )  # fmt: skip
    elif have == STATE_KEYS_32BIT:
        m, v = st["state1"].float(), st["state2"].float()
    elif have == TORCH_STATE_KEYS:
        m, v = st["exp_avg"].float(), st["exp_avg_sq"].float()
    else:
        raise ValueError(f"optimizer state with keys {sorted(have)} is neither torch's AdamW "
                         "state nor bitsandbytes' AdamW8bit state")  # fmt: skip
    if want == TORCH_STATE_KEYS:
        return {"step": torch.tensor(count), "exp_avg": m, "exp_avg_sq": v}
    if want == STATE_KEYS_32BIT:
        return {"step": int(count), "state1": m, "state2": v}
    F = import_bitsandbytes().functional
    out: dict = {"step": int(count)}
    for i, (t, name) in enumerate(((m, "dynamic"), (v, "udynamic")), start=1):
        code = device_opt.inner.name2qmap[name].to(t.device)
        q, qs = F.quantize_blockwise(t.contiguous(), code=code, blocksize=BLOCK)
        out[f"state{i}"], out[f"absmax{i}"], out[f"qmap{i}"] = q, qs.absmax, code
    return out


def plain_state_dict(opt: torch.optim.Optimizer) -> dict:
    """``opt.state_dict()`` with each parameter's state flat (bitsandbytes nests its 8-bit
    tensors in one dict per parameter; its ``load_state_dict`` takes them flat too) and
    every tensor its own (its quantization maps are one tensor for all parameters), so
    that a checkpoint writes each tensor under its own name. torch's state is unchanged."""
    sd = opt.state_dict()
    state = {}
    for i, st in sd["state"].items():
        flat = {k: v for k, v in st.items() if not isinstance(v, dict)}
        for nested in (v for v in st.values() if isinstance(v, dict)):
            flat.update(nested)
        state[i] = {k: v.clone() if k in QMAP_KEYS else v for k, v in flat.items()}
    return {**sd, "state": state, "optimizer": optimizer_choice(opt)}


def optimizer_choice(opt: torch.optim.Optimizer) -> str:
    """The ``optimizer`` choice a checkpoint names: the engine's own, else bitsandbytes'
    8-bit AdamW or torch's."""
    if type(opt).__module__.startswith("bitsandbytes"):  # its own optimizer_name is "adam"
        return "adamw_8bit"
    return getattr(opt, "optimizer_name", "adamw")


def saved_choice(name: str | None) -> str | None:
    """The ``optimizer`` choice a checkpoint's marker names: "adam", bitsandbytes' own
    ``optimizer_name`` for its AdamW8bit, which some checkpoints carry, is "adamw_8bit"."""
    return "adamw_8bit" if name == "adam" else name


def check_saved_optimizer(sd: dict, optimizer: str) -> None:
    """Refuse a plain optimizer state dict saved with the other ``optimizer`` choice (the
    choice :func:`plain_state_dict` names; older checkpoints: told by their state's keys).
    bitsandbytes' ``load_state_dict`` takes torch's AdamW state and fails at the first step."""
    check_saved_format(sd, "fp32", "run")  # the chunked engine's compact host moments
    saved = saved_choice(sd.get("optimizer"))
    if saved is None and sd.get("state"):
        saved = "adamw_8bit" if any("state1" in st for st in sd["state"].values()) else "adamw"
    if saved is not None and saved != optimizer:
        raise ValueError(
            f"optimizer state_dict does not match: it was saved with optimizer={saved!r}, "
            f"this run's is {optimizer!r}; resume with the optimizer it was saved with"
        )


def import_bitsandbytes():
    """bitsandbytes, or an ImportError that says the 8-bit optimizer needs it."""
    try:
        # optional dependency (bitsandbytes, the qlora extra)
        import bitsandbytes
    except ImportError as exc:
        raise ImportError(
            "protrain: optimizer='adamw_8bit' needs bitsandbytes (pip install bitsandbytes)"
        ) from exc
    return bitsandbytes


class DeviceAdamW8bit:
    """``bnb.optim.AdamW8bit`` over the given groups, stepped parameter by parameter with
    its own ``init_state`` and ``update_step``. Its ``step()`` also synchronizes the device
    after every parameter (for paged state, which this one never is) and applies
    ``GlobalOptimManager`` overrides; both are left out: the step stays asynchronous on the
    compute stream, as torch's fused AdamW is."""

    def __init__(self, groups: list[dict]) -> None:
        bnb = import_bitsandbytes()
        self.inner = bnb.optim.AdamW8bit(groups, min_8bit_size=MIN_8BIT_SIZE)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self) -> None:
        opt = self.inner
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if not opt.state[p]:
                    opt.init_state(group, p, gi, pi)
                opt.update_step(group, p, gi, pi)

    def shared_qmap(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """The map a fresh state holds for ``key`` (``qmap1``/``qmap2``) where ``value``
        equals it, so that loaded state shares one map as a fresh one does."""
        name = "dynamic" if key == "qmap1" else "udynamic"
        qmap = self.inner.name2qmap[name] = self.inner.name2qmap[name].to(value.device)
        return qmap if torch.equal(qmap, value) else value
