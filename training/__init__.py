"""Training and evaluation of the bundled models: data preparation (:mod:`training.data`), tokenizer
training (:mod:`training.bpe`), the shared loop (:mod:`training.loop`), one trainer per task
(:mod:`training.translation`, :mod:`training.lm`, :mod:`training.vit`), evaluation
(:mod:`training.evaluate`) and the command line (:mod:`training.cli`)."""
