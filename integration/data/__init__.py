"""What a run trains on.

- :mod:`.corpus`: records in, fixed-length token sequences out; the shipped corpus.
- :mod:`.instructions`: prompt/completion pairs or chats, the loss counting the answer only.
- :mod:`.inputs`: the model, tokenizer, corpus and eval set resolved and checked before any
  worker starts.
"""
