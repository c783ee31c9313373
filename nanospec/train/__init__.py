"""The speculators' trainer, apart from the runtime: ``python -m nanospec.train`` (see ``__main__``).

    prompts.py, prompt_templates.py   the prompt set the target answers (``prompts.jsonl``)
    record.py                         the target's continuations with their hidden states
    data.py                           held-out prompts, teacher-forced examples
    loop.py                           the training loop, checkpoints, the plot
    eagle3.py, eagle3_run.py          an EAGLE-3 head: the unrolled training-time test, its data and run
"""
