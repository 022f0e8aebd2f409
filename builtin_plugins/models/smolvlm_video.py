"""SmolVLM2 video frames -> the tower's tiles and the prompt's run, as transformers'
``SmolVLMVideoProcessor`` and ``SmolVLMProcessor`` do.

Frames (:func:`video_frames_steps`): each frame made RGB, its longest side resized to the
video ``size``'s ``longest_edge`` (the other side kept in proportion, rounded up to even),
then resized to the ``max_image_size`` square (videos are never split into tiles), both
with ``resample`` (Lanczos by default; PIL here where HF's video processor resizes with
torchvision, so frames that need resizing differ by interpolation rounding), rescaled and
normalized with the video processor's mean and std: one ``[3, M, M]`` tile per frame. The
settings are transformers' for the checkpoint's ``video_preprocessor_config.json`` (else
``preprocessor_config.json``): ``size`` when the config has one, else
``video_sampling.video_size`` (transformers' precedence), ``4 * 364`` by default.

Prompt (:func:`video_run_text`): the ``<video>`` of the prompt becomes ``You are provided the
following series of {count in words} frames from a {H:MM:SS} [H:MM:SS] video.\\n``, then for
each frame ``\\nFrame from {MM:SS}:`` and one tile's image text
(``<fake_token_around_image><global-img>`` + ``image_seq_len`` ``<image>`` +
``<fake_token_around_image>``), then ``\\n\\n``. A frame's time is ``frames_indices[i] / fps``
(the video's metadata; frames numbered 0, 1, ... and 24 fps without it, transformers'
defaults); the duration is the metadata's ``duration`` in whole seconds, else the last
frame's time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from chassis.builtin_plugins.models.idefics3_processing import Idefics3Tiles

#: the frame rate assumed when neither the video nor the request gives one (transformers')
DEFAULT_FPS = 24.0
#: ``SmolVLMVideoProcessor``'s default ``size``
DEFAULT_VIDEO_SIZE = {"longest_edge": 4 * 364}
_ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> str:
    """``n`` (0 .. 999999) in English words as ``num2words`` writes them (``twenty-one``,
    ``one hundred and five``, ``two thousand, three hundred and forty-five``), which
    ``SmolVLMProcessor`` writes a frame count with."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"a frame count must be in 0 .. 999999; got {n}")

    def below_hundred(k: int) -> str:
        if k < 20:
            return _ONES[k]
        tens, ones = divmod(k, 10)
        return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")

    def below_thousand(k: int) -> str:
        hundreds, rest = divmod(k, 100)
        if not hundreds:
            return below_hundred(rest)
        head = f"{_ONES[hundreds]} hundred"
        return f"{head} and {below_hundred(rest)}" if rest else head

    thousands, rest = divmod(n, 1000)
    if not thousands:
        return below_thousand(rest)
    head = f"{below_thousand(thousands)} thousand"
    if not rest:
        return head
    return f"{head}, {below_thousand(rest)}" if rest >= 100 else f"{head} and {below_hundred(rest)}"


def video_frames_steps(config: Mapping[str, Any]) -> Idefics3Tiles:
    """The frame steps of a video processor config (module docstring): Idefics3's image
    steps without splitting, at the video size."""
    sampling = config.get("video_sampling") or {}
    size = config.get("size") or sampling.get("video_size") or DEFAULT_VIDEO_SIZE
    settings = {
        k: v
        for k, v in config.items()
        if k not in ("image_processor_type", "video_processor_type", "video_sampling")
    }
    settings.update(size=size, do_image_splitting=False)
    return Idefics3Tiles.from_dict(settings)


def frame_times(indices: Sequence[int], fps: float) -> list[float]:
    """Each kept frame's time in seconds."""
    return [index / fps for index in indices]


def video_run_text(times: Sequence[float], duration: float | None, image_seq_len: int) -> str:
    """The text that replaces a video's ``<video>`` (module docstring); ``duration`` in
    seconds (``None``: the last frame's time)."""
    seconds = int(duration) if duration is not None else int(times[-1])
    text = (
        f"You are provided the following series of {number_words(len(times))} frames from a "
        f"{timedelta(seconds=seconds)} [H:MM:SS] video.\n"
    )
    tile = (
        "<fake_token_around_image><global-img>"
        + "<image>" * image_seq_len
        + "<fake_token_around_image>"
    )
    for t in times:
        minutes, secs = int(t // 60), int(t % 60)
        text += f"\nFrame from {minutes:02d}:{secs:02d}:{tile}"
    return text + "\n\n"
