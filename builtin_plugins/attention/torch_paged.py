"""``torch_paged``: the reference paged-attention backend, in plain PyTorch.

It is the definition of correct that faster backends are tested against, and the CPU
platform's default. The code favours being obviously right; it is fast only where that stays
simple: all single-token decodes of a step share one padded gather and one SDPA call, and
only prefill chunks (query length > 1) are handled one request at a time.

An 8-bit KV cache (``--kv-cache-dtype fp8`` / ``fp8_e5m2``) is the reference too: K/V are
divided by the layer's ``k_scale``/``v_scale``, saturated to the dtype's finite range and
rounded to nearest on write (:func:`quantize_kv`), and multiplied back in float32 on read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chassis.core.attention import FP8_KV_DTYPES, AttentionBackend, AttentionMetadata


class TorchPagedAttention(AttentionBackend):
    """Paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

    Softmax is computed in float32 whatever the cache dtype; the output has the query's dtype.
    A sliding window and chunked local attention (``attention_chunk_size``; a request whose
    context fits in one chunk is plain causal) are masks; a logit soft cap or attention
    sinks, which SDPA cannot apply, switch to the explicit float32 softmax of :meth:`_attend`
    (the sink logit of each head as one more column of the softmax, dropped before
    ``p . v``). ``metadata.attend_limit``
    (bidirectional image blocks) is the mask's bound ``k <= attend_limit[q]`` in place of
    ``k <= position`` for prefill chunks; a decode's limit is its own position (the
    contract), so decodes ignore it.
    """

    supports_sliding_window = True
    supports_chunked_attention = True
    supports_logits_soft_cap = True
    supports_attention_sinks = True
    supported_kv_cache_dtypes = FP8_KV_DTYPES  # both, via quantize_kv
    fp8_kv_cache_needs_device_support = False  # torch's conversions run anywhere
    #: the planes are only indexed (``kv_cache[blocks, 0, offsets]``, ``kv_cache[ids]``),
    #: never viewed as one contiguous tensor: a V plane aliasing the K plane works
    supports_aliased_kv_planes = True
    #: the prefill mask's bound (see the class docstring)
    supports_attend_limit = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        write_kv_cache(
            kv_cache,
            key[:num_tokens],
            value[:num_tokens],
            metadata.slot_mapping,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

        output = torch.zeros_like(query)
        starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        decode_reqs: list[int] = []
        limits = metadata.attend_limit
        for i in range(metadata.num_reqs):
            query_len = starts[i + 1] - starts[i]
            if query_len == 1:
                decode_reqs.append(i)
            elif query_len > 1:
                output[starts[i] : starts[i + 1]] = self._prefill(
                    query[starts[i] : starts[i + 1]],
                    kv_cache,
                    metadata.block_table[i],
                    seq_lens[i],
                    None if limits is None else limits[starts[i] : starts[i + 1]],
                )
        if decode_reqs:
            token_rows = torch.tensor([starts[i] for i in decode_reqs], device=query.device)
            output[token_rows] = self._decode(
                query[token_rows],
                kv_cache,
                metadata.block_table[decode_reqs],
                [seq_lens[i] for i in decode_reqs],
            )
        return output

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_ids: torch.Tensor,
        seq_len: int,
        limits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One request's chunk: ``query [Q, H, D]`` are the last ``Q`` of ``seq_len`` tokens;
        ``limits [Q]`` (None: causal) the last position each may attend to."""
        query_len = query.shape[0]
        block_size = kv_cache.shape[2]
        num_blocks = -(-seq_len // block_size)
        # [n, 2, block_size, KV, D] -> [2, n * block_size, KV, D] -> first seq_len tokens
        kv = kv_cache[block_ids[:num_blocks].long()].transpose(0, 1).flatten(1, 2)[:, :seq_len]
        q = query.transpose(0, 1).float()  # [H, Q, D]
        k = self._dequantized(kv[0].transpose(0, 1), self.k_scale)  # [KV, L, D]
        v = self._dequantized(kv[1].transpose(0, 1), self.v_scale)
        chunk = self.attention_chunk_size
        plain = (
            self.sliding_window is None
            and (chunk is None or seq_len <= chunk)  # one chunk: plain causal
            and self.logits_soft_cap is None
            and self.sinks is None
        )
        if query_len == seq_len and plain and limits is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            # Query row j sits at absolute position seq_len - query_len + j.
            q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            last = q_pos if limits is None else limits.to(q_pos.device, torch.long)
            mask = k_pos[None, :] <= last[:, None]  # [Q, L], True = may attend
            if self.sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - self.sliding_window
            if chunk is not None:  # from the start of the query's own chunk on
                mask &= k_pos[None, :] >= q_pos[:, None] // chunk * chunk
            out = self._attend(q, k, v, mask)
        return out.transpose(0, 1).to(query.dtype)

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: list[int],
    ) -> torch.Tensor:
        """All decodes at once: ``query [B, H, D]``, one new token per request."""
        num_cache_blocks, _, block_size = kv_cache.shape[:3]
        max_len = max(seq_lens)
        max_blocks = -(-max_len // block_size)
        # Table entries past a request's own blocks are arbitrary: clamp them to a valid id;
        # what they point to is masked out below.
        block_ids = block_table[:, :max_blocks].long().clamp(0, num_cache_blocks - 1)
        # [B, n, 2, block_size, KV, D] -> [2, B, n * block_size, KV, D]
        kv = kv_cache[block_ids].permute(2, 0, 1, 3, 4, 5).flatten(2, 3)[:, :, :max_len]
        q = query.unsqueeze(2).float()  # [B, H, 1, D]
        k = self._dequantized(kv[0].transpose(1, 2), self.k_scale)  # [B, KV, L, D]
        v = self._dequantized(kv[1].transpose(1, 2), self.v_scale)
        lens = torch.tensor(seq_lens, device=query.device)
        k_pos = torch.arange(max_len, device=query.device)[None, :]
        mask = k_pos < lens[:, None]  # [B, L]; the query sits at position lens - 1
        if self.sliding_window is not None:
            mask &= k_pos >= lens[:, None] - self.sliding_window
        chunk = self.attention_chunk_size
        if chunk is not None:
            mask &= k_pos >= (lens[:, None] - 1) // chunk * chunk
        out = self._attend(q, k, v, mask[:, None, None, :])
        return out.squeeze(2).to(query.dtype)

    @staticmethod
    def _dequantized(stored: torch.Tensor, scale: float) -> torch.Tensor:
        """Cache values in float32; an 8-bit cache's times its per-tensor ``scale``."""
        if stored.dtype in FP8_KV_DTYPES and scale != 1.0:
            return stored.float() * scale
        return stored.float()

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Masked attention, float32: ``q [..., H, Q, D]``, ``k``/``v [..., KV, L, D]``,
        ``mask`` broadcastable to ``[..., H, Q, L]`` (True = may attend)."""
        if self.logits_soft_cap is None and self.sinks is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
        cap = self.logits_soft_cap
        if cap is None:
            scores = (q @ k.transpose(-1, -2)) * self.scale
        else:
            scores = torch.tanh((q @ k.transpose(-1, -2)) * (self.scale / cap)) * cap
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is None:
            return torch.softmax(scores, dim=-1) @ v
        # one more column per head holding its sink logit: it joins the denominator only
        sink = self.sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)
        return probs[..., :-1] @ v


def write_kv_cache(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``key``/``value [T, KV, D]`` at ``slot_mapping [>= T]``; slots ``< 0`` are skipped.

    An 8-bit ``kv_cache`` gets ``quantize_kv(key, dtype, k_scale)`` (and ``v_scale`` for V);
    other caches the values cast to their dtype (the scales unused).
    """
    block_size = kv_cache.shape[2]
    slots = slot_mapping[: key.shape[0]].long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = quantize_kv(key, kv_cache.dtype, k_scale)
    kv_cache[blocks, 1, offsets] = quantize_kv(value, kv_cache.dtype, v_scale)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as stored in a ``dtype`` cache: for an 8-bit float dtype ``x / scale`` in float32,
    saturated to the dtype's largest finite magnitude (448 for e4m3fn, 57344 for e5m2; the
    plain cast would give NaN or inf) and rounded to nearest even; for others ``x`` cast."""
    if dtype not in FP8_KV_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    scaled = x.float() if scale == 1.0 else x.float() / scale
    return scaled.clamp(-limit, limit).to(dtype)
