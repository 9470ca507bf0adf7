"""Training and evaluation of the bundled models: data preparation (:mod:`model.train.data`), tokenizer
training (:mod:`model.train.bpe`), the shared loop (:mod:`model.train.loop`), one trainer per task
(:mod:`model.train.translation`, :mod:`model.train.lm`, :mod:`model.train.vit`), evaluation
(:mod:`model.train.evaluate`) and the command line (:mod:`model.train.cli`)."""
