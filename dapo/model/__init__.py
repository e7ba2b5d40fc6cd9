"""The policy's sources: a hub name, a GGUF file converted once, or the embedded tiny policy
warm-started here (model_source, policy), the matrix of model families the tests run
(policy_matrix), and the packed-sequence attention (varlen_attention)."""
