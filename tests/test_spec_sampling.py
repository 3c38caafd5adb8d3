"""Temperature > 0: tree speculative sampling preserves the target's distribution (statistical tests,
fixed seeds). Tolerances are chosen so a correct sampler fails with probability < 1e-3."""
from __future__ import annotations

import itertools

import pytest
import torch

from eagle3_platform.spec.config import SpecConfig
from eagle3_platform.spec.engine import SpecEngine
from eagle3_platform.spec.tree import Tree
from eagle3_platform.spec.verify import _sample_residual, verify_sampling
from eagle3_platform.testing.spec import VariedTargetConfig, random_draft, varied_target


pytestmark = pytest.mark.usefixtures("one_torch_thread")

P_MIN = 1e-3  # reject "same distribution" below this chi-square p-value


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < min_expected are pooled."""
    n = counts.sum()
    expected = probs * n
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), stat / 2))


def test_chi_square_helper_has_power():
    p = torch.tensor([0.5, 0.3, 0.2])
    assert chi_square_pvalue(torch.tensor([500.0, 300.0, 200.0]), p) > 0.9
    assert chi_square_pvalue(torch.tensor([560.0, 260.0, 180.0]), p) < P_MIN


def test_verify_sampling_emits_exact_target_draws():
    """Hand-made tree, V=5: the first emitted token ~ p(root), the second (after accepting node 1) ~ p(node 1)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 5, generator=gen) * 1.5  # [N,V] rows = target logits after each node
    logits[0] = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])  # the root's first child (tok 0) is likely
    #   root -> [1: tok 0, 2: tok 1];  1 -> [3: tok 2, 4: tok 0];  2 -> []
    tree = Tree(torch.tensor([4, 0, 1, 2, 0]), torch.tensor([-1, 0, 0, 1, 1]))
    probs = torch.softmax(logits, -1)
    first, second = torch.zeros(5), torch.zeros(5)
    for _ in range(3000):
        path, bonus = verify_sampling(tree, logits, 1.0, gen)
        emitted = tree.tokens[path[1:]].tolist() + [bonus]
        first[emitted[0]] += 1
        if path[1:2] == [1]:
            second[emitted[1]] += 1
    assert chi_square_pvalue(first, probs[0]) > P_MIN
    assert chi_square_pvalue(second, probs[1]) > P_MIN
    assert second.sum() > 1000  # node 1 was accepted often enough to test its level


def test_rejecting_all_of_the_support_through_rounding_still_draws_a_token():
    """Siblings that hold all of p's support can all be rejected when fp32 rounding leaves a few 1e-8
    of `mass`: the residual is then all zeros, which torch.multinomial refuses. The draw falls back to
    p instead of failing the step (and with it every request in the batch)."""
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    for seed in range(20):
        tok = _sample_residual(p, [0, 1], 6e-8, 1e-12, torch.Generator().manual_seed(seed))
        assert tok in (0, 1)  # p's support: an exact draw is impossible here, any of it will do
    # an ordinary residual is still drawn without the rejected tokens
    q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    assert all(_sample_residual(q, [0, 1], 0.3, 1e-12, torch.Generator().manual_seed(s)) in (2, 3)
               for s in range(20))


@torch.no_grad()
def exact_sequence_probs(model, prompt: list[int], length: int, vocab: int, temperature: float):
    """P(x_1..x_length | prompt) for every sequence, in itertools.product order: [vocab**length]."""
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)))  # [S,length]
    x = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    logp = torch.log_softmax(model(input_ids=x).logits.double() / temperature, dim=-1)
    steps = logp[:, len(prompt) - 1:-1]  # [S,length,V]: distribution of x_k given the prefix
    return steps.gather(-1, seqs[..., None])[..., 0].sum(-1).exp().float()


def test_speculative_sampling_matches_target_sampling():
    """Joint law of the first 3 tokens with a random-draft tree (V=4, 64 outcomes) vs the exact law,
    at T=0.7 (so temperature scaling is exercised on both sides). ~20 ms per sample."""
    vocab, length, n, temperature = 4, 3, 1000, 0.7
    # init 0.08: flat enough that random draft tokens are often accepted (the tree path is exercised)
    target = varied_target(None, VariedTargetConfig(num_hidden_layers=3, vocab_size=vocab, seed=1,
                                                    initializer_range=0.08))
    engine = SpecEngine(target, random_draft(target, vocab, seed=2), SpecConfig(3, 2, 6))
    prompt = [0, 3, 1, 2, 1]
    counts, accepted = torch.zeros(vocab ** length), 0
    for seed in range(n):
        out, stats = engine.generate(prompt, length, temperature=temperature, seed=seed)
        counts[int(sum(t * vocab ** (length - 1 - i) for i, t in enumerate(out)))] += 1
        accepted += sum(v for k, v in stats["accept_hist"].items() if k > 1)
    probs = exact_sequence_probs(target.model, prompt, length, vocab, temperature)
    assert abs(float(probs.sum()) - 1) < 1e-4
    assert accepted > n // 2  # draft tokens were accepted: the tree path of the sampler was exercised
    assert chi_square_pvalue(counts, probs) > P_MIN
