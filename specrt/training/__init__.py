"""Training tools for specrt: the built-in model pair and draft distillation.

Modules (each exposes ``main(argv: list[str] | None = None)``):

- ``corpus``      stdlib source corpus with a fixed held-out module list
- ``tokenizer``   byte-level BPE tokenizer trained with ``tokenizers``
- ``pretrain``    train the Llama target (tqdm, checkpoints, ``--resume``)
- ``distill``     layer-init / scratch draft, KL distillation (corpus + on-policy)
- ``accept_head`` train the acceptance-prediction head of the ``head`` policy
- ``evaluate``    held-out loss, draft acceptance, int8 trade-off
- ``recipe``      the exact settings used for ``specrt/builtin`` (retrain end to end)
"""
