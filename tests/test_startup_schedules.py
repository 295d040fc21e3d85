"""The learning-rate schedules longctx builds itself equal transformers' `get_scheduler`.

longctx builds them from torch's LambdaLR so that a rank never imports
`transformers.optimization` (which imports peft and bitsandbytes); this test may import it,
and holds every schedule, argument and refusal to transformers' own.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from transformers.optimization import get_scheduler

from longctx_cli.config.schema import Config
from longctx_cli.train import optim

LR = 0.1
NAMES = Config.flat_fields()["lr_scheduler"].annotation.__args__
# Arguments each schedule is tried with beyond its defaults (transformers' names).
KWARGS: dict[str, list[dict[str, Any]]] = {
    "linear": [{}],
    "cosine": [{}, {"num_cycles": 2.0}, {"num_cycles": 0.3}],
    "cosine_with_restarts": [{}, {"num_cycles": 3}],
    "polynomial": [{}, {"lr_end": 1e-3, "power": 2.0}, {"power": 0.5}],
    "constant": [{}, {"ignored": 1}],
    "constant_with_warmup": [{}, {"ignored": 1}],
    "inverse_sqrt": [{}, {"timescale": 7}, {"timescale": 2.5}],
    "reduce_lr_on_plateau": [{}, {"patience": 1, "factor": 0.5}],
    "cosine_with_min_lr": [{"min_lr_rate": 0.0}, {"min_lr_rate": 0.1},
                           {"min_lr": 0.01, "num_cycles": 1.0}],
    "cosine_warmup_with_min_lr": [{"min_lr_rate": 0.1}, {"min_lr": 0.02},
                                  {"min_lr_rate": 0.05, "warmup_lr_rate": 0.2}],
    "warmup_stable_decay": [
        {"num_decay_steps": 3}, {"num_decay_steps": 2, "num_cycles": 1.0},
        {"num_decay_steps": 2, "num_stable_steps": 1},
        *({"num_decay_steps": 4, "warmup_type": kind, "decay_type": kind, "min_lr_ratio": 0.1}
          for kind in ("linear", "cosine", "1-sqrt")),
    ],
}
# (warmup, total) step counts: none, some and all of the run warming up, and a 1-step run.
LENGTHS = [(0, 10), (3, 10), (4, 37), (10, 10), (0, 1)]


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=LR)


def _theirs(name: str, warmup: int, total: int, kwargs: dict[str, Any]):
    opt = _optimizer()
    return opt, get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total,
                              scheduler_specific_kwargs=dict(kwargs))


def _ours(name: str, warmup: int, total: int, kwargs: dict[str, Any]):
    opt = _optimizer()
    return opt, optim.build_schedule(name, opt, warmup, total, dict(kwargs))


def _rates(opt: torch.optim.Optimizer, schedule: Any, steps: int, plateau: bool) -> list[float]:
    """The learning rate before each of `steps` steps (the plateau one on a loss that stalls)."""
    rates = []
    for step in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step(1.0 if step > 2 else 2.0 - step) if plateau else schedule.step()
    return rates


def _outcome(build, *args) -> tuple[str, Any]:
    """("ok", (optimizer, schedule)) or (error type name, None)."""
    try:
        return "ok", build(*args)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        return type(e).__name__, None


def test_every_name_is_covered():
    assert set(KWARGS) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_schedule_equals_transformers(name):
    """Every learning rate of every step (and past the end) is transformers' exactly, and so
    is the state a checkpoint saves."""
    plateau = name == "reduce_lr_on_plateau"
    compared = 0
    for kwargs in KWARGS[name]:
        for warmup, total in LENGTHS:
            theirs = _outcome(_theirs, name, warmup, total, kwargs)
            ours = _outcome(_ours, name, warmup, total, kwargs)
            assert theirs[0] == ours[0], (kwargs, warmup, total)
            if theirs[0] != "ok":
                continue
            (their_opt, their_schedule), (our_opt, our_schedule) = theirs[1], ours[1]
            steps = total + 5
            try:
                expected = _rates(their_opt, their_schedule, steps, plateau)
            except ZeroDivisionError:  # polynomial with no decay steps: ours must agree
                with pytest.raises(ZeroDivisionError):
                    _rates(our_opt, our_schedule, steps, plateau)
                continue
            assert _rates(our_opt, our_schedule, steps, plateau) == expected, (
                kwargs, warmup, total)
            assert _state(our_schedule) == _state(their_schedule)
            compared += 1
    assert compared


def _state(schedule: Any) -> dict:
    state = schedule.state_dict()
    state.pop("_get_lr_called_within_step", None)
    return state


@pytest.mark.parametrize("name,kwargs", [
    ("cosine", {"num_cyclez": 2}),
    ("linear", {"num_cycles": 2}),
    ("polynomial", {"lr_end": LR}),
    ("cosine_with_min_lr", {"min_lr": 0.01, "min_lr_rate": 0.1}),
    ("cosine_with_min_lr", {}),
    ("warmup_stable_decay", {"num_decay_steps": 2, "warmup_type": "exp"}),
    ("warmup_stable_decay", {"num_decay_steps": 2, "decay_type": "exp"}),
    ("warmup_stable_decay", {}),
    ("reduce_lr_on_plateau", {"num_cycles": 2}),
    ("inverse_sqrt", {"num_cycles": 2}),
])
def test_refusals_match_transformers(name, kwargs):
    theirs = _outcome(_theirs, name, 2, 10, kwargs)[0]
    assert theirs != "ok"
    assert _outcome(_ours, name, 2, 10, kwargs)[0] == theirs


def test_checkpoint_of_transformers_schedule_resumes_ours():
    """A run saved by the transformers-built schedule continues on ours at the same rates."""
    their_opt, theirs = _theirs("cosine", 3, 20, {})
    _rates(their_opt, theirs, 8, plateau=False)
    our_opt, ours = _ours("cosine", 3, 20, {})
    our_opt.load_state_dict(their_opt.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert _rates(our_opt, ours, 12, False) == _rates(their_opt, theirs, 12, False)


def test_make_scheduler_imports_no_trainer_code():
    """A rank builds its schedule without transformers' trainer utilities, peft or
    bitsandbytes (a fresh interpreter: this one imported them above)."""
    code = (
        "import sys, torch\n"
        "from longctx_cli.config.load import config_from_dict\n"
        "from longctx_cli.train.optim import make_optimizer, make_scheduler\n"
        "cfg = config_from_dict({'model_config': {'model_type': 'llama', 'hidden_size': 64,"
        " 'intermediate_size': 128, 'num_hidden_layers': 1, 'num_attention_heads': 4,"
        " 'vocab_size': 384}, 'tokenizer': 'byte', 'datasets': [{'type': 'passkey'}],"
        " 'lr_scheduler': 'cosine', 'cosine_min_lr_ratio': 0.1, 'warmup_steps': 2})\n"
        "opt = make_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2))])\n"
        "make_scheduler(cfg, opt, 10)\n"
        "print(sorted(m for m in ('transformers.optimization', 'transformers.trainer_utils',"
        " 'peft', 'bitsandbytes', 'torchao') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
