"""What the LLM trainers (GRPO, CRSP, guidance) share: model loading and LoRA (``model``),
sampling (``generation``), packed per-token log-probs (``packed_logprobs``), the clipped policy
loss and gradient accumulation (``policy_loss``), prompt order (``prompts``), math tasks and
answer checking (``tasks``), the device (``device``), the settings types the helpers take
(``settings``) and the config base with the common fields (``config``)."""
