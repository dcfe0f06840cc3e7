"""ProTrain's engine in axolotl (protrain installed from its repository into axolotl's
environment, ``pip install --no-deps -e .``; see examples/axolotl/README.md): add to the YAML ::

    plugins:
      - protrain.integrations.axolotl.ProTrainPlugin
    protrain_memory:          # the memory: section of protrain's own config
      auto: true
      gpu_budget: 24GiB

``plugin.py`` says which hooks of axolotl's plugin API it uses and why; ``args.py`` is the
``protrain_memory`` schema and how it maps onto the engine. Importing this package does not
import axolotl (see ``plugin.py``), and protrain's core never imports this package.
"""

from protrain.integrations.axolotl.plugin import ProTrainPlugin

__all__ = ["ProTrainPlugin"]
