"""Model parallelism: the ranks' layout (``layout``), tensor-parallel plans (``tensor_parallel``),
pipeline plans and stages (``pipeline_split``, ``pipeline``) and the gradient norm over them
(``gradients``). The strategies in ``distrain/strategies/model_parallel.py`` and ``pipeline.py`` join them."""
