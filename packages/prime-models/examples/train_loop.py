"""A plain PyTorch training loop on prime_models alone: tiny random Qwen3, packed rows, fused log-prob loss."""

import tempfile

import torch
from prime_models import ParallelDims, get_model_spec, load_model, save_hf

config = {
    "model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
}  # fmt: skip
model = load_model(config, seed=0)  # or load_model("/path/to/hf_dir", dtype=torch.bfloat16, device="cuda")
# AC (and FSDP2 when launched with torchrun on several ranks) through the family's parallelize function.
get_model_spec("qwen3").parallelize_fn(model, ParallelDims(), ac="selective", ac_every=2)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

# Two samples (lengths 20 and 12) packed into one row: position_ids restart at 0 at each sample.
tokens = torch.randint(0, 256, (1, 33), generator=torch.Generator().manual_seed(0))
position_ids = torch.cat([torch.arange(20), torch.arange(12)]).unsqueeze(0)
losses = []
for step in range(20):
    logprobs, entropy = model(tokens[:, :-1], position_ids, targets=tokens[:, 1:], temperature=1.0)
    loss = -logprobs.mean()  # an RL loss would weight the log-probs by advantages here
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
    if step % 5 == 0:
        print(f"step {step} loss {loss.item():.3f} entropy {entropy.mean().item():.3f}")

with tempfile.TemporaryDirectory() as out:
    save_hf(model, out)  # an HF dir: transformers / vLLM open it as is
assert losses[-1] < losses[0], losses
