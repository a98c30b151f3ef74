"""The run's bookkeeping: every release accounted across resumes, branches and repeated ``train()`` calls.

* ``session``: the privacy session: the ledger written before every release, resumes, runs on one model.
* ``ledger``: ``privacy_ledger.json``, every step ever released from a model.
* ``unit_identity``: the privacy unit a run was started with, checked on resume.
* ``guard``: what ``DPTrainer`` checks when it is created and when ``train()`` starts.
* ``training_fields``: the declared status of every ``TrainingArguments`` field.
* ``eval_overlap``: evaluation sets sharing rows with the training set, refused unless opted in.
* ``start_report``: the plan printed before training, with its warnings.
* ``progress``: epsilon logged at every epoch's end and at the last step; the expected duration of a long run.
"""
