"""The models: Hugging Face causal LMs as DeepSpeed pipeline layers.

- :mod:`.model_config`: the presets and ``save_pretrained`` directories, resolved without
  DeepSpeed.
- :mod:`.layers`: each family's blocks, embeddings and head as pipeline layers.

The single-process transformers reference for the pipeline's math (the tests' and benches'
oracle) trains through the worker's parts, so it sits above them: :mod:`spotline.reference`.
"""
