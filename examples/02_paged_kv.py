"""Paged KV blocks, watched: blocks are reserved as requests grow and return to the pool when they end.

    python examples/02_paged_kv.py

A tiny pool (24 blocks of 16 tokens) makes the traffic visible: each request's block table grows
one block every 16 tokens, and finished requests hand their blocks back while others keep running.
"""

import argparse

from nanospec import LLM, SamplingParams

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

llm = LLM(num_blocks=24, block_size=16)
engine, bm = llm.engine, llm.engine.block_manager


def show(label: str) -> None:
    used = bm.num_blocks - bm.num_free_blocks
    bar = "#" * used + "." * bm.num_free_blocks
    tables = {seq.seq_id: list(seq.block_table) for seq in engine.scheduler.running}
    print(f"{label:<28} [{bar}] {used:>2}/{bm.num_blocks} used  tables={tables}")


show("empty pool")
prompts = ["Tell me a short story about a lighthouse.", "List three fruits.", "Count from one to ten in words."]
for i, prompt in enumerate(prompts):
    ids = llm.tokenizer.encode(prompt)
    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=20 + 30 * i, ignore_eos=True))

step = 0
while engine.has_unfinished():
    outputs = engine.step()
    step += 1
    finished = [o for o in outputs if o.finished]
    if step == 1 or finished or step % 10 == 0:
        show(f"step {step:>3}" + (f" (request {finished[0].request_id} done)" if finished else ""))
    for o in finished:
        engine.pop_finished(o.request_id)

show("all done")
assert bm.num_free_blocks == bm.num_blocks, "every block is back in the pool"
print("slot of token i = block_table[i // 16] * 16 + i % 16; every block is back:", llm.kv_cache_stats())
