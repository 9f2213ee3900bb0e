"""Speculative decoding: proposers guess the next k tokens cheaply, the target model checks them all
in one forward pass (k + 1 query rows of the sequence in the flat batch), and a lossless rule keeps
the longest acceptable prefix plus one token of the target's own.

SpeculativeConfig (the `speculative_config` dict, validated) is in tokenfab/config.py.

- `ngram.py`    prompt lookup: the tokens that followed the latest earlier match of the last n tokens
- `draft.py`    a smaller model with the target's tokenizer, its KV pool block for block beside the target's
- `layerskip.py` self-speculative: the target's first L layers + final norm + LM head draft greedily
- `verify.py`   greedy acceptance and rejection sampling against the fully processed target distribution
- `policy.py`   k per sequence maximising expected tokens per step cost, back-off, the batch-size switch
- `decoder.py`  SpecDecoder: what the engine calls each step (propose, verify, commit, counters)
"""
