"""`gradian attribute`: which training rows broke a behaviour the base model had.

One concern per module (imports point down this list):

    evaluate    the eval items, scored on one model (log-probability, greedy match, margin)
    regression  the accuracy drop with a paired bootstrap CI, flipped items, base-model blame
    queries     query gradients of the regressed items through the index's capture and projection
    engines     every row's score per engine (dot, cosine, influence, kfac, ekfac), accused rows, agreement
    rows        the accused rows' lines and texts, `gradian diagnose` findings on the training set
    spans       the sentences of long accused rows, one gradient and score each (the drill-down)
    clusters    TF-IDF + agglomerative clusters of the accused rows, their shares and shared findings
    retrain     a plain trainer: the fine-tune redone from its base model on prompt/completion rows
    verify      --verify: retrained without the accused rows and without as many random rows, scored
    result      the typed result file: one writer, one reader
    run         `attribute()`: the steps in order
    command     the command's arguments and terminal tables (imports no torch)
    stage       the pipeline's attribute stage (after grads): `run` on the run's index, attribute.json

This package's `__init__` imports nothing, so `gradian --help` stays light.
"""
