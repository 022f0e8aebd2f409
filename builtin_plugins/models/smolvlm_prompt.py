"""SmolVLM2 videos placed in a prompt as ``SmolVLMProcessor`` places them: its ``<video>``
replaced by the video's run *as text*, before the prompt is tokenized.

The run (:func:`~.smolvlm_video.video_run_text`) begins and ends with plain text (its intro
and first ``Frame from MM:SS:``; its closing ``\\n\\n``) around a core that begins and ends
with ``<fake_token_around_image>``. The tokenizer splits text at its added tokens and
tokenizes each piece between them alone, so the core's tokens are the same wherever the run
sits, but the intro and the closing join the prompt text next to them: ``"User: " + "You
are"`` is ``User``, ``:``, ``ĠYou``, not ``Ġ`` then ``You``, and ``"\\n\\n" + "What"`` is two
``Ċ``, not ``ĊĊ``. :func:`place_video_runs` therefore re-tokenizes each piece of prompt text
that holds a ``<video>`` (the tokenizer's one token, or the text ``<video>`` when the tokenizer
has no such token, as the released SmolVLM2 tokenizers may not) together with the runs'
edges, as HF does, and leaves every other token as it is.

A video's feature covers its run: from the first token holding a character of its intro to
the last holding one of its closing (a token shared with the prompt's text or with the next
video's intro goes to the earlier item); its ``placeholder_ids`` are those tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from chassis.core.multimodal import MultiModalFeature, make_feature

#: the text a SmolVLM2 chat template writes for a video
VIDEO_TOKEN = "<video>"
#: a prompt piece: its start in the prompt, its text ("" for an added token), its token ids
Piece = tuple[int, str, list[int]]


class VideoPrompt:
    """Places video runs in prompts tokenized by ``tokenizer`` (a fast tokenizer: the runs'
    edges are found by character offsets); ``video_token_id``: ``<video>``'s id when the
    tokenizer has it as one token (it is then read as the text ``<video>``)."""

    def __init__(self, tokenizer: Any, video_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.video_token_id = video_token_id
        #: the ids the tokenizer splits text at (its added tokens), but ``<video>``'s
        self.splits = frozenset(int(i) for i in tokenizer.added_tokens_decoder) - {video_token_id}

    def pieces(self, ids: Sequence[int]) -> list[Piece]:
        """``ids`` as pieces: each added token alone and each run of other tokens between
        them with its text."""
        pieces: list[Piece] = []
        start = 0
        for i, token in enumerate([*ids, None]):
            if token is not None and token not in self.splits:
                continue
            if i > start:
                segment = list(ids[start:i])
                pieces.append((start, self._text(segment), segment))
            if token is not None:
                pieces.append((i, "", [token]))
            start = i + 1
        return pieces

    @staticmethod
    def count(pieces: Sequence[Piece]) -> int:
        """How many ``<video>`` the pieces hold (token or text)."""
        return sum(text.count(VIDEO_TOKEN) for _, text, _ in pieces)

    def place(
        self,
        pieces: Sequence[Piece],
        features: Sequence[MultiModalFeature],
        runs: Sequence[tuple[torch.Tensor, dict[str, torch.Tensor]]],
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt of ``pieces`` (images expanded, ``features`` theirs) with the i-th
        ``<video>`` replaced by ``runs[i]``: its run's token ids (the run tokenized alone)
        and its other tensors; the video features added, every feature in prompt order
        (module docstring). The caller checked that the pieces hold ``len(runs)`` videos."""
        out: list[int] = []
        moved: dict[int, int] = {}  # (an added token's index in the prompt -> in out)
        spans: list[list[int]] = []  # (each video's [start, end) in out)
        edges = iter([self._edges(run) for run, _ in runs])
        for start, text, segment in pieces:
            if VIDEO_TOKEN not in text:
                if not text:
                    moved[start] = len(out)
                out.extend(segment)
                continue
            parts = text.split(VIDEO_TOKEN)
            tail = ""
            for k, part in enumerate(parts):
                last = k == len(parts) - 1
                head, core, closing = ("", [], "") if last else next(edges)
                piece = tail + part + head
                base = len(out)
                offsets = self._offsets(piece)
                out.extend(token for token, _ in offsets)
                if k:  # (the previous run ends at its closing's last token)
                    spans[-1][1] = base + sum(1 for _, (a, _) in offsets if a < len(tail))
                if not last:  # (this run starts at its intro's first token)
                    before = sum(1 for _, (_, b) in offsets if b <= len(tail + part))
                    spans.append([base + before, len(out) + len(core)])
                    out.extend(core)
                    tail = closing
        placed = [msgspec.structs.replace(f, offset=moved[f.offset]) for f in features]
        for (_, tensors), (start, end) in zip(runs, spans, strict=True):
            # (a token shared with the previous video's closing stays the previous video's)
            start = max([start, *(f.end for f in placed if f.offset < start)])
            run = torch.tensor(out[start:end], dtype=torch.int64)
            data = {**tensors, "placeholder_ids": run}
            placed.append(make_feature("video", start, end - start, data))
        return out, sorted(placed, key=lambda f: f.offset)

    def _text(self, segment: list[int]) -> str:
        """A segment's text, ``<video>``'s token as :data:`VIDEO_TOKEN`."""
        text, chunk = "", []
        for token in [*segment, None]:
            if token is None or token == self.video_token_id:
                text += self.tokenizer.decode(chunk, clean_up_tokenization_spaces=False)
                text += VIDEO_TOKEN if token is not None else ""
                chunk = []
            else:
                chunk.append(token)
        return text

    def _edges(self, run: torch.Tensor) -> tuple[str, list[int], str]:
        """A run's intro text, its core (its first to last added token) and its closing."""
        ids = run.tolist()
        marks = [i for i, token in enumerate(ids) if token in self.splits]
        if not marks:
            raise ValueError("a video's run holds no added token (is the tokenizer the model's?)")
        decode = self.tokenizer.decode
        return (
            decode(ids[: marks[0]], clean_up_tokenization_spaces=False),
            ids[marks[0] : marks[-1] + 1],
            decode(ids[marks[-1] + 1 :], clean_up_tokenization_spaces=False),
        )

    def _offsets(self, text: str) -> list[tuple[int, tuple[int, int]]]:
        """``text``'s tokens, each with its character span."""
        if not text:
            return []
        try:
            encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError as exc:  # (a slow tokenizer has no offsets)
            raise ValueError(
                "videos need the model's fast tokenizer (tokenizer.json): a video's run is "
                "placed by character offsets"
            ) from exc
        return list(zip(encoded["input_ids"], encoded["offset_mapping"], strict=True))
