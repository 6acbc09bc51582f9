"""How a row is stored: dense (the default), factored (rank-c factors per module block) and signs
(one bit per coordinate).
"""
