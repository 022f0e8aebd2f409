"""GLM-4.1V / GLM-4.5V images -> the model's inputs, as transformers' ``Glm4vProcessor``.

Qwen2-VL's front-end (:class:`~.qwen2_vl_processing.Qwen2VLImageInputs`) over the
checkpoint's own image processor (transformers' ``AutoImageProcessor`` over
``preprocessor_config.json``: ``Glm4vImageProcessor``, whose PIL backend needs no
torchvision). GLM's processor resizes with its own rule (both sides rounded to multiples of
``patch_size * merge_size``, the pixel count times ``temporal_patch_size`` bounded by
``size["shortest_edge"]`` / ``size["longest_edge"]``, images smaller than one factor
scaled up first), normalizes with CLIP's mean and std and cuts ``pixel_values``
``[t*h*w, 3 * temporal_patch_size * patch_size**2]`` with ``image_grid_thw`` ``[1, 3]``.

The chat template writes ``<|begin_of_image|><|image|><|end_of_image|>`` for an image; its
one ``<|image|>`` is expanded to ``t * h * w / merge_size**2`` tokens (vLLM's prompt
convention, what HF's processor writes). ``mm_processor_kwargs`` may set ``min_pixels`` and
``max_pixels`` (they replace the two ``size`` bounds, as for Qwen2-VL).
"""

from __future__ import annotations

from chassis.builtin_plugins.models.qwen2_vl_processing import Qwen2VLImageInputs

#: the text standing for one image in a GLM-4.1V prompt (what its chat template writes)
IMAGE_PLACEHOLDER = "<|begin_of_image|><|image|><|end_of_image|>"


class Glm4vImageInputs(Qwen2VLImageInputs):
    """Images of GLM-4.1V / GLM-4.5V requests (module docstring): ``image_token_id`` is the
    ``<|image|>`` id (the config's ``image_token_id``)."""

    def prompt_placeholder(self, modality: str) -> str:
        return IMAGE_PLACEHOLDER
