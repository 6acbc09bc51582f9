"""Per-example gradients on the supervised tokens: the loss and its gradient at the logits, the hooks
that hand each module's projected (input, output-gradient) pair on, and the sites a circuit keeps.
"""
