"""The one flat, ragged batch a forward pass sees (vLLM / nano-vllm call it attention metadata).

All new tokens of all sequences are concatenated; sequence ``s`` owns query rows
``query_start_loc[s] : query_start_loc[s+1]``. ``tree_mask`` (optional, int64 bit words ``[num_tokens, W]``) says which
new tokens of its own sequence each new token may see, its context always visible; absent means causal.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from nanospec.cache.block_manager import slots_of
from nanospec.kernels.attention_mask import causal_mask, concat_masks


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64 (RoPE positions: context_len + depth for trees)
    slot_mapping: torch.Tensor     # [T] int64: where each new token writes its K/V (-1: nowhere)
    block_tables: torch.Tensor     # [S, max_blocks] int32
    seq_lens: torch.Tensor         # [S] int32: cached context plus new tokens
    query_start_loc: torch.Tensor  # [S+1] int32
    max_query_len: int
    logits_indices: torch.Tensor   # [R] int64: the rows whose next-token logits are wanted
    tree_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


TENSOR_FIELDS = [f.name for f in fields(ForwardBatch) if f.name != "max_query_len"]  # all but max_query_len


def build_forward_batch(token_lists: list[list[int]], start_positions: list[int], block_tables: list[list[int]],
                        block_size: int, logits_rows: list[list[int]], device: torch.device | str,
                        positions: list[list[int]] | None = None, tree_masks: list[torch.Tensor | None] | None = None,
                        ) -> ForwardBatch:
    """Flatten per-sequence work: ``token_lists[s]``, the new tokens of sequence ``s``, stored from index
    ``start_positions[s]``; ``logits_rows[s]``, indices into ``token_lists[s]`` whose logits are wanted; ``positions``
    and ``tree_masks`` override the default RoPE positions (storage indices) and causal mask, per sequence."""
    input_ids, pos, slots, logits_indices, qsl = [], [], [], [], [0]
    for s, tokens in enumerate(token_lists):
        start, table = start_positions[s], block_tables[s]
        input_ids.extend(tokens)
        pos.extend(positions[s] if positions is not None and positions[s] is not None
                   else range(start, start + len(tokens)))
        slots.extend(slots_of(table, block_size, range(start, start + len(tokens))))
        logits_indices.extend(qsl[-1] + r for r in logits_rows[s])
        qsl.append(qsl[-1] + len(tokens))
    tables = torch.zeros((len(block_tables), max([1, *map(len, block_tables)])), dtype=torch.int32)
    for s, table in enumerate(block_tables):
        tables[s, : len(table)] = torch.tensor(table, dtype=torch.int32)
    tree_mask = None
    if tree_masks is not None and any(m is not None for m in tree_masks):
        tree_mask = concat_masks([m if m is not None else causal_mask(len(token_lists[s]))
                                  for s, m in enumerate(tree_masks)]).to(device)
    lens = [start_positions[s] + len(t) for s, t in enumerate(token_lists)]
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(pos, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_query_len=max((len(t) for t in token_lists), default=0),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        tree_mask=tree_mask,
    )
