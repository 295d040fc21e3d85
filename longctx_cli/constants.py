"""Values every layer shares; a leaf module (imports nothing), so `parallel` may use it too."""

# The label of a token that carries no loss: torch's cross_entropy default ignore_index,
# and what Hugging Face datasets and collators write.
IGNORE_INDEX = -100
