"""Hugging Face models and datasets as distrain jobs.

- ``models``: config / model / tokenizer from a hub name or a local directory, the task, the
  model's repeated layer classes (FSDP units and activation checkpointing).
- ``data``: ``datasets.load_dataset`` for hub names and local files, tokenized once (rank 0 first,
  the other ranks read the cache), optional packing, and the batch collator.
- ``tasks``: ``CausalLMModule`` and ``SequenceClassificationModule`` (``distrain.Module``).
- ``export``: a distrain checkpoint → a ``from_pretrained`` directory.
- ``job``: what ``distrain train --model_name <hf model>`` runs.
- ``tiny``: tiny models, tokenizers and datasets built locally (examples, tests: no download).

Importing ``distrain`` never imports transformers; only these modules do.
"""
