"""The engines: rollout (vLLM, or Hugging Face's generate), the trainer (DeepSpeed, or plain
torch), and the policy update that runs the algorithm's loss on a trainer (update)."""
