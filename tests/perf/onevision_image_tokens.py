"""LLaVA-OneVision's image token counts at llava-onevision-qwen2's geometry (384-pixel
SigLIP tiles of 27 x 27 features, pinpoints 1..6 x 1..6 tiles, ``anyres_max_9``) for a few
image sizes: the figures in docs/models.md ("LLaVA-OneVision: images and videos") and
docs/serving.md. ``tests/test_llava_onevision_images.py`` checks the same function against
``LlavaOnevisionProcessor`` over 36 sizes.

    python tests/perf/onevision_image_tokens.py
"""

from __future__ import annotations

from chassis.builtin_plugins.models.llava_next_tiles import parse_pinpoints
from chassis.builtin_plugins.models.llava_onevision_geometry import num_image_tokens

#: (width, height) in pixels
SIZES = [(384, 384), (640, 480), (1024, 768), (1920, 1080), (2000, 2000)]


def main() -> None:
    """Print each size's token count for one image alone in its prompt."""
    pinpoints = parse_pinpoints([[h * 384, w * 384] for h in range(1, 7) for w in range(1, 7)], 384)
    for width, height in SIZES:
        count = num_image_tokens(height, width, pinpoints, 384, 27, 729, 9)
        print(f"{width} x {height}: {count:,} tokens")


if __name__ == "__main__":
    main()
