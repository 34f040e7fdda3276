"""SiTU activation and the SiTU-GLU MLP (docs/k3-model.md §6)."""
import torch
import torch.nn as nn

from .norm import compute_dtype


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, beta_lin: float | None = 25.0,
             f32: bool = True) -> torch.Tensor:
    """beta*tanh(g/beta)*sigmoid(g) * beta_lin*tanh(u/beta_lin), in float32 (float64 kept; f32=False: as given)."""
    dt = compute_dtype(gate) if f32 else gate.dtype
    g, u = gate.to(dt), up.to(dt)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if beta_lin is not None:
        u = beta_lin * torch.tanh(u / beta_lin)
    return (a * u).to(gate.dtype)


class SituMLP(nn.Module):
    """Dense SiTU-GLU MLP (layer 0) and the shared expert: gate/up [I, d], down [d, I]."""

    def __init__(self, d: int, inter: int, beta: float, beta_lin: float | None):
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)
        self.beta, self.beta_lin = beta, beta_lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.beta_lin))
