"""Which module's call must bring in which parameters: the reads the module tree hides.

The chunk runtime makes a parameter resident when a module holding it is called. Some
forwards read parameters without calling the module that owns them:

- peft tuner layers that read their adapters' (and base layer's) weights themselves:
  ``ParamWrapper`` (``target_parameters``, the LoRA of fused MoE experts and routers, whose
  forward folds ``lora_B @ lora_A`` into the targeted parameter and never calls
  ``lora_A``/``lora_B``), LoRA variants such as DoRA, ``lora.MultiheadAttention``, trainable
  tokens, and any other tuner type but plain LoRA (which calls its ``base_layer``,
  ``lora_A`` and ``lora_B``); such a layer's call brings in its whole subtree;
- modules parametrized with ``torch.nn.utils.parametrize``: the parametrized module reads
  ``parametrizations.<name>.original`` through its property; the same;
- modules whose own code reads a child's ``weight`` or ``bias`` (``self.conv1d.weight``):
  ``nn.MultiheadAttention`` (its ``out_proj``), the Mamba-style and gated-delta-net mixers
  of state-space and linear-attention models, which pass their ``conv1d`` (and in kernel
  paths ``out_proj`` and ``norm``) weights to functions; found in the source of the
  module's class, once per class; the same;
- parameters of a module that has no ``forward`` (``nn.ParameterList``,
  ``nn.ParameterDict``, a container): they are read by the nearest enclosing module that
  has one.

A parameter of a module without a forward that no enclosing module with a forward covers
is ``uncovered``: nothing would bring it in, and ``protrain.wrap`` refuses it when its chunk
is offloaded. Reads the tree does not show (a forward reading a sibling's weight, a loss
reading ``lm_head.weight`` outside ``lm_head``'s call) are not found here.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass
from functools import cache

from torch import nn
from torch.nn.utils import parametrize


@dataclass(frozen=True)
class DirectReads:
    """``groups``: module name -> full names of the parameters its call must make resident
    besides its own (every name of a shared parameter). ``uncovered``: parameters that no
    module call brings in, with the type of the module holding them."""

    groups: dict[str, tuple[str, ...]]
    uncovered: dict[str, str]


def has_forward(module: nn.Module) -> bool:
    """Whether ``module`` can be called (containers and parameter lists cannot)."""
    return type(module).forward is not nn.Module.forward


# a read of the values: not of ``.dtype``/``.device``/``.shape`` nor an ``isinstance`` test
# (T5's MLP checks ``self.wo.weight``'s type and dtype), which need no residency
_CHILD_PARAM_READ = re.compile(
    r"(?<!isinstance\()self\.(\w+)\.(?:weight|bias)\b"
    r"(?!\.(?:dtype|device|shape|requires_grad|is_meta))"
)


@cache
def _children_read_in_source(cls: type) -> frozenset[str]:
    """Attribute names ``x`` of ``self.x.weight`` / ``self.x.bias`` in the code of ``cls``
    and its bases (nn.Module itself excluded). Whole Hugging Face models are skipped: their
    code reads children's weights to initialize and tie them, and calls the children."""
    names: set[str] = set()
    if any(k.__name__ == "PreTrainedModel" for k in cls.__mro__):
        return frozenset()
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or klass.__module__.startswith("torch.nn.modules.module"):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # built in, or defined where no source is kept
            continue
        names.update(_CHILD_PARAM_READ.findall(source))
    return frozenset(names)


def _reads_child_params(module: nn.Module) -> bool:
    read = _children_read_in_source(type(module))
    return any(
        name in read and any(True for _ in child.parameters())
        for name, child in module.named_children()
    )


def _reads_subtree(module: nn.Module) -> bool:
    """Whether ``module``'s forward reads parameters of its subtree without calling the
    modules that own them (see the module docstring)."""
    if parametrize.is_parametrized(module):
        return True
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None or not isinstance(module, tuners.BaseTunerLayer):
        return _reads_child_params(module)
    lora = sys.modules.get("peft.tuners.lora.layer")
    if lora is None or not isinstance(module, lora.LoraLayer):
        return True  # other tuner types: not known to call their children
    if isinstance(module, (lora.ParamWrapper, lora.MultiheadAttention)):
        return True
    # LoRA variants (DoRA and others) compute from the weights themselves
    return bool(getattr(module, "lora_variant", None)) or any(
        getattr(module, "use_dora", {}).values()
    )


def direct_reads(model: nn.Module) -> DirectReads:
    """The reads of ``model`` that its module tree hides (see the module docstring)."""
    groups: dict[str, list[str]] = {}
    uncovered: dict[str, str] = {}

    def visit(module: nn.Module, name: str, reader: str | None) -> None:
        prefix = f"{name}." if name else ""
        if has_forward(module):
            reader = name
        elif reader is None:
            for n, _ in module.named_parameters(prefix=name, recurse=False):
                uncovered[n] = type(module).__name__
        else:
            own = [n for n, _ in module.named_parameters(prefix=name, recurse=False)]
            groups.setdefault(reader, []).extend(own)
        if _reads_subtree(module):
            groups.setdefault(name, []).extend(
                n for n, _ in module.named_parameters(prefix=name, remove_duplicate=False)
            )
        for child_name, child in module.named_children():
            visit(child, prefix + child_name, reader)

    visit(model, "", None)
    return DirectReads(
        groups={k: tuple(dict.fromkeys(v)) for k, v in groups.items() if v}, uncovered=uncovered
    )
