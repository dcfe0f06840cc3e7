"""Whether a model family keeps packed samples apart: `sample_packing` refuses one that does not.

A packed micro-batch is one row of several samples whose `position_ids` restart at each
sample (`train/data/collate.py`). Most transformers families derive a per-sample mask from
those positions, so a sample attends only within itself; some do not, and a packed sample
then silently attends to (or carries recurrent state from) the samples before it. Measured
with transformers 5.24 on tiny random models: OPT, BioGPT, XGLM and Bloom build their mask
without `position_ids`; GPT-OSS's eager attention ignores them; Mamba, Mamba-2,
FalconMamba, Jamba, Bamba and Qwen3-Next carry state across the row. Qwen2-VL and
Qwen2.5-VL take 3-D (mrope) positions that a packed row's 1-D ones do not carry.

So, rather than a list that goes stale with the next transformers release, the family is
probed: a tiny random model of the same type (two layers, fp32, on the CPU, the run's RNG
untouched) runs sample B packed after sample A and B alone; B's logits must agree to 1e-4
(the leaks measured are 1e-3 to 2; agreement is ~1e-7). Families with multimodal rotary
positions (`mrope_section`) are refused without a probe. The probe runs SDPA where the run
takes flex_attention or a flash kernel: all of them take the mask transformers derives
from the same `position_ids`, and neither flex's compile nor flash kernels run on every CPU.
A family whose tiny model cannot be built is not refused; the log says it was not checked.
"""

from __future__ import annotations

import functools
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

from protrain.train.log import logger

_TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
_SAMPLE_A = list(range(5, 25))
_SAMPLE_B = list(range(30, 45))
_TOLERANCE = 1e-4
_PROBED = ("eager", "sdpa")  # what the probe runs; anything else probes through SDPA


def packing_problem(config, attn_implementation: str | None) -> str | None:
    """Why packed rows of a model with ``config`` would mix samples, or None where they keep
    them apart (or the family could not be checked: logged)."""
    text = getattr(config, "text_config", None) or config
    if _takes_3d_positions(config) or _takes_3d_positions(text):
        return (
            f"{config.model_type!r} takes 3-D (mrope) positions, which a packed row's "
            "restarting 1-D position_ids do not carry"
        )
    attn = attn_implementation if attn_implementation in _PROBED else "sdpa"
    return _probe(text.model_type, text.to_json_string(use_diff=False), attn)


def _takes_3d_positions(config) -> bool:
    """Multimodal rotary positions: the config's `mrope_section`, or a model class that
    computes them itself (`get_rope_index`, as Qwen2-VL's and GLM-4V's do)."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = getattr(config, key, None)
        if isinstance(rope, dict) and "mrope_section" in rope:
            return True
    found = MODEL_MAPPING.get(type(config), None)
    classes = found if isinstance(found, (list, tuple)) else [found]
    return any(hasattr(c, "get_rope_index") for c in classes if c is not None)


@functools.cache
def _probe(model_type: str, config_json: str, attn: str) -> str | None:
    """The probe of one text config (its JSON, for the cache) under ``attn``."""
    errors = []
    for config in _tiny_configs(model_type, json.loads(config_json)):
        try:
            diff, attn_run = _packed_difference(config, attn)
        except Exception as exc:  # a tiny size the family cannot take: the next try
            errors.append(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
            continue
        if diff > _TOLERANCE:
            return (
                f"{model_type!r} with {attn_run} attention lets a packed sample see the "
                f"samples before it (a tiny model's logits differ by {diff:.1e} from the "
                "sample alone)"
            )
        return None
    logger.warning(
        "sample_packing: could not check that %r keeps packed samples apart (%s); training "
        "as configured",
        model_type,
        "; ".join(errors[-1:]) or "no tiny config",
    )
    return None


def _tiny_configs(model_type: str, saved: dict):
    """Tiny configs to probe, best first: the run's own config at the tiny sizes (its
    alibi, windows and layer types kept, `layer_types` cut to the tiny depth), then the
    family's defaults at those sizes, each also without `head_dim` (read-only where the
    family derives it, as Falcon does)."""
    own = {k: v for k, v in saved.items() if k not in ("architectures", "auto_map")}
    if isinstance(own.get("layer_types"), list):
        own["layer_types"] = own["layer_types"][: _TINY["num_hidden_layers"]]
    no_head_dim = {k: v for k, v in _TINY.items() if k != "head_dim"}
    for base in (own, {}):
        for sizes in (_TINY, no_head_dim):
            try:
                yield AutoConfig.for_model(model_type, **{**base, **sizes})
            except Exception:  # noqa: S112 - a tiny config the family refuses: the next
                continue


@torch.no_grad()
def _packed_difference(config, attn: str) -> tuple[float, str]:
    """Largest |logit| difference of sample B packed after sample A against B alone, in a
    random model of ``config`` (the run's RNG untouched), and the attention it ran."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:
        raise ValueError(f"no causal LM class for {type(config).__name__}")
    if not getattr(model_class, "_supports_sdpa", False):
        attn = "eager"  # what the run chose for it too (train/attention.py)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                 dtype=torch.float32).eval()  # fmt: skip
    ids = torch.tensor([_SAMPLE_A + _SAMPLE_B])
    positions = torch.tensor([list(range(len(_SAMPLE_A))) + list(range(len(_SAMPLE_B)))])
    packed = model(input_ids=ids, position_ids=positions).logits[0, len(_SAMPLE_A) :]
    alone = model(input_ids=torch.tensor([_SAMPLE_B])).logits[0]
    return (packed - alone).abs().max().item(), attn
