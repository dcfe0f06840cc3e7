"""ProTrain's engine under the Hugging Face ``Trainer`` (``pip install protrain[hf]``).

``ProTrainTrainer`` is a ``transformers.Trainer`` whose model and optimizer are the
engine's; ``ProTrainConfig`` holds the engine's knobs. See ``trainer.py`` for which
Trainer methods it overrides and why. TRL's ``SFTTrainer``: ``ProTrainSFTTrainer`` in
``protrain.integrations.transformers.sft`` (needs ``trl``, not imported here).
"""

from protrain.integrations.transformers.checkpoint import ENGINE_STATE_NAME
from protrain.integrations.transformers.config import ProTrainConfig
from protrain.integrations.transformers.trainer import ProTrainTrainer

__all__ = ["ENGINE_STATE_NAME", "ProTrainConfig", "ProTrainTrainer"]
