"""Drawing one token id per row from probabilities without a host synchronization.

The exponential race: ``argmax(probs / E)`` with ``E ~ Exponential(1)`` i.i.d. picks token
``i`` with probability ``probs[i] / sum(probs)`` (the smallest of ``E_i / p_i`` wins a race
of exponential clocks with rates ``p_i``). Unlike ``torch.multinomial`` it needs no
host-side check of the input, and tokens of probability 0 can never win. The default
sampler draws with it, and so do draft-model drafts and rejection sampling
(:mod:`chassis.core.rejection_sampling`).
"""

from __future__ import annotations

import torch


def exponential_noise(
    shape: tuple[int, ...],
    device: torch.device | str,
    generators: dict[int, torch.Generator] | None = None,
) -> torch.Tensor:
    """I.i.d. float32 Exponential(1) values of ``shape`` (``[rows, vocab]``), as ``-log U``.

    Rows in ``generators`` (row -> generator on ``device``) draw their ``U`` from their own
    generator, exactly one float32 ``[vocab]`` uniform vector per row, in row order, so a
    seeded request's draws do not depend on the other rows; the remaining rows use the
    default generator of the device. ``U == 0`` gives ``inf``, a token that cannot win a race;
    ``E`` is never 0, so a race never divides 0 by 0.

    Always float32, whatever the probabilities' dtype: the uniforms a generator gives, and
    for some dtypes (float64) how far a draw advances it, depend on the dtype, and
    :func:`chassis.core.seeded_drafts.skip_draws` (which moves seeded requests' generators
    past draws made elsewhere) advances them by float32 vectors.
    """
    # -log(U) is several times faster than exponential_() on the CPU.
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    generators = generators or {}
    if len(generators) < shape[0]:
        noise.uniform_()
    for row, generator in generators.items():
        noise[row].uniform_(generator=generator)
    return noise.log_().neg_()


def exponential_race(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator] | None = None,
    noise: torch.Tensor | None = None,
    consume: bool = False,
) -> torch.Tensor:
    """One id per row of ``probs`` (``[rows, vocab]``, non-negative; rows need not sum to
    1), drawn with probability proportional to its entry: ``argmax(probs / E)``.

    ``noise`` is ``E`` when given (a test feeds the same values to two implementations);
    else it is drawn by :func:`exponential_noise` with ``generators`` (float32). The race
    runs in float32 at least, so ``probs`` of a lower precision draw the token their float32
    copy draws with the same generators. ``consume=True`` divides ``probs`` in place (no
    second ``[rows, vocab]`` tensor) where they have the noise's dtype.
    """
    if noise is None:
        noise = exponential_noise(tuple(probs.shape), probs.device, generators)
    # (in place, a float16/bfloat16 quotient would be rounded and could tie another token's)
    in_place = consume and probs.dtype == noise.dtype
    scaled = probs.div_(noise) if in_place else probs / noise
    return scaled.argmax(dim=-1)
