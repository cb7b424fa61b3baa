"""gradclip inside the trainers users run, one module per framework, each through the
framework's own extension point where it has one (a config-reachable target, a subclass of a
public class, a callback, a plugin) and saying so where a patch is the only way:

- ``gradclip.integrations.nemo``: NeMo Automodel's LLM recipe (its ``clip_grad_norm`` contract).
- ``gradclip.integrations.transformers``: transformers' ``Trainer`` (through accelerate).
- ``gradclip.integrations.lightning``: Lightning's ``gradient_clip_val`` (a precision plugin).
- ``gradclip.integrations.torchtitan``: torchtitan's ``dist_utils.clip_grad_norm_`` contract and
  optimizer container.
- ``gradclip.integrations.deepspeed``: gradclip's optimizers as DeepSpeed's client optimizer,
  ZeRO-1/2 included.

Importing ``gradclip`` imports none of them, and each imports its framework only when used.
Each states the framework releases it is tested with (``TESTED``) and refuses another with
``UntestedFramework``, which says how to go on regardless (``GRADCLIP_UNTESTED_FRAMEWORKS=1``).
See docs/integrations.md."""
