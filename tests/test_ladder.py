"""The step at the busy rows: the engine keeps its busy rows in the lowest rows (moving a row's cache, decode
state and sampling down when one below it frees) and runs the step at the smallest size of the ladder that
holds them. Nothing a row produces may depend on it: every row's tokens are what its prompt gives alone."""
import pytest
import torch

from generate import Engine
from model import load
from policies import POLICIES
from sampling import Sampling
from step import Stepper, batch_sizes

EOS = [3, 9, 17, 21, 30, 31]  # ids the tiny model meets often: rows end at different steps


def test_the_ladder_is_dense_where_a_row_costs_most_of_a_step_and_ends_at_the_batch():
    assert batch_sizes(224) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208,
                                224]
    assert batch_sizes(70) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 70]
    assert batch_sizes(3) == [1, 2, 3] and batch_sizes(1) == [1]


@pytest.fixture(scope="module")
def engine(checkpoints):
    """The tiny Qwen3 in float64, eager: rows run at many batch sizes here, and in float32 the CPU's matrix
    products round a row differently at different sizes, which can flip a near-tie (this file tests where rows
    go, not rounding)."""
    model, _ = load(str(checkpoints["qwen3"]), torch.device("cpu"), torch.float32)
    return Engine(model.double(), compile=False)


@pytest.fixture
def moves(monkeypatch):
    """Every move the engine makes, and every size its step runs at."""
    seen = dict(moved=[], sizes=set())
    move, call = Stepper.move_rows, Stepper.__call__

    def spy_move(self, src, dst):
        seen["moved"] += list(zip(src, dst))
        move(self, src, dst)

    def spy_call(self):
        seen["sizes"].add(self.size)
        call(self)
    monkeypatch.setattr(Stepper, "move_rows", spy_move)
    monkeypatch.setattr(Stepper, "__call__", spy_call)
    return seen


PROMPTS = [[(i * 7 + j) % 50 + 1 for j in range(3 + 9 * (i % 4))] for i in range(6)]  # 3 to 30 tokens
# greedy and sampled rows, with and without a repetition penalty, in one batch (a Sampler's rows move too)
SAMPLING = [Sampling(), Sampling(temperature=1.0, top_p=0.9, repetition_penalty=1.3),
            Sampling(repetition_penalty=1.5)] * 2


@pytest.mark.parametrize("policy", list(POLICIES))
def test_moving_busy_rows_down_changes_no_rows_tokens(engine, moves, policy):
    """Six prompts, greedy and sampled, on three rows: refilled as rows free, then a tail that shrinks. Each
    prompt's tokens equal its run alone, while rows moved and the step ran at smaller sizes."""
    budget = None if policy == "full" else 64
    alone = [engine.generate([p], 40, EOS, budget, policy, s, seed=5 + i, batch_size=1)[0][0]
             for i, (p, s) in enumerate(zip(PROMPTS, SAMPLING))]
    moves["sizes"].clear()
    together, _ = engine.generate(PROMPTS, 40, EOS, budget, policy, SAMPLING, seed=5, batch_size=3)
    assert together == alone
    assert moves["moved"], "no row was moved: the test did not test compaction"
    assert max(moves["sizes"]) == 3 and min(moves["sizes"]) < 3, "the step ran at the whole batch and below it"


def test_teacher_forcing_moves_its_continuations_with_their_rows(engine, moves):
    """Continuations of different lengths end at different steps: each row's records follow it when it moves.
    The tokens and argmaxes are exact; the log-probabilities within 1e-12 (float64 rounding at other sizes)."""
    continuations = [[(3 * i + j) % 40 + 1 for j in range(5 + 13 * i)] for i in range(len(PROMPTS))]
    together, _ = engine.score(PROMPTS, continuations, 64, "longflow", batch_size=9)
    for p, c, got in zip(PROMPTS, continuations, together):
        (want,), _ = engine.score([p], [c], 64, "longflow", batch_size=1)
        assert [(t, a) for t, _, a in got] == [(t, a) for t, _, a in want]
        torch.testing.assert_close(torch.tensor([lp for _, lp, _ in got]), torch.tensor([lp for _, lp, _ in want]),
                                   rtol=0, atol=1e-12)
    assert moves["moved"] and 1 in moves["sizes"]
