"""Training and evaluation of the bundled models: data preparation (:mod:`tserve.training.data`), tokenizer
training (:mod:`tserve.training.bpe`), the shared loop (:mod:`tserve.training.loop`), one trainer per task
(:mod:`tserve.training.translation`, :mod:`tserve.training.lm`, :mod:`tserve.training.vit`), evaluation
(:mod:`tserve.training.evaluate`) and the command line (:mod:`tserve.training.cli`)."""
