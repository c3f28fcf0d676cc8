"""The GRPO-on-GSM8K recipe's helpers: data, scoring, the local model, the embedded engine."""
