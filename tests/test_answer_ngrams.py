"""The answer n-gram table (draft/answer_ngrams.py): what it keeps, how it drafts, its file, and the lookup
branch falling back to it (greedy output unchanged, fp32, tiny target)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from eagle3_platform.draft import answer_ngrams as an
from eagle3_platform.draft.answer_ngrams import MIN_SHARE, AnswerNgrams
from eagle3_platform.spec.config import PRESETS
from eagle3_platform.spec.engine import SpecEngine
from eagle3_platform.spec.lookup import LookupDrafter
from eagle3_platform.spec.tree import Tree
from eagle3_platform.testing.spec import random_draft

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_table_drafts_each_contexts_most_frequent_successor():
    # after 5: 6 twice, 8 once -> 6 (share 2/3); after 5 6: 7 twice; after 7: 9 always
    table = AnswerNgrams.build([[1, 5, 6, 7, 9], [2, 5, 6, 7, 9], [3, 5, 8]])
    assert table.answer_tokens == 13
    assert table.chain([4, 5], 5) == [6, 7, 9]  # 9 ends every answer: nothing follows it
    assert table.chain([4, 5], 2) == [6, 7]  # the caller's cap
    assert table.chain([4, 42], 5) == []  # 42 never occurred: no context known
    assert table.chain([], 5) == [] and table.chain([4, 5], 0) == []


def test_the_longest_known_context_decides_and_a_split_one_stops_the_chain():
    # after 1 2: 3 or 4 (share 1/2 each, the lowest id on the tie); after 9 2: 5 always; after 2: 3, 4, 5, 5
    table = AnswerNgrams.build([[1, 2, 3], [1, 2, 4], [9, 2, 5], [9, 2, 5]])
    assert table.chain([9, 2], 1) == [5]  # "9 2" known: its successor, not the shorter "2"'s
    assert table.chain([1, 2], 1) == ([3] if 0.5 >= MIN_SHARE else [])  # a tie: share 1/2
    assert table.chain([7, 2], 1) == [5]  # "7 2" unknown: "2" decides (5 followed half of its 4)
    assert AnswerNgrams.build([[1, 2, 3], [1, 2, 4], [1, 2, 5]]).chain([1, 2], 1) == []  # share 1/3 < MIN_SHARE


def test_contexts_are_hashed_alike_in_tensors_and_python():
    windows = torch.tensor([[0, 1, 2], [49151, 7, 0], [3, 3, 3]])
    assert an._hash(windows).tolist() == [an._hash_one(w) for w in windows.tolist()]
    assert an._hash_one([1, 2]) != an._hash_one([1, 2, 0]) != an._hash_one([0, 1, 2])  # lengths apart
    rows = torch.randint(0, 50000, (20000, 4), generator=torch.Generator().manual_seed(0))
    assert len(set(an._hash(rows).tolist())) == len({tuple(r) for r in rows.tolist()})  # no collision


def test_the_table_round_trips_through_its_file_and_refuses_a_corrupt_one(tmp_path):
    table = AnswerNgrams.build([[1, 5, 6, 7, 9], [2, 5, 6, 7, 9], [3, 5, 8]])
    info = table.save(tmp_path / "t.safetensors")
    assert info["contexts"] == len(table) > 0 and info["answer_tokens"] == 13
    back = AnswerNgrams.load(tmp_path / "t.safetensors")
    assert back.keys.tolist() == table.keys.tolist() and back.tokens.tolist() == table.tokens.tolist()
    assert back.answer_tokens == 13 and back.chain([4, 5], 5) == [6, 7, 9]
    save_file({"keys": table.keys.flip(0).contiguous(), "tokens": table.tokens, "shares": table.shares},
              str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="not sorted"):
        AnswerNgrams.load(tmp_path / "bad.safetensors")
    save_file({"keys": table.keys}, str(tmp_path / "partial.safetensors"))
    with pytest.raises(ValueError, match="missing shares, tokens"):
        AnswerNgrams.load(tmp_path / "partial.safetensors")


def test_a_plain_step_falls_back_to_the_answers_only_without_a_long_own_match():
    root = Tree(torch.tensor([7]), torch.tensor([-1]))
    answers = AnswerNgrams.build([[30, 31, 32, 33, 34, 35, 36]])  # each token always followed by the next
    off = LookupDrafter(head=None, max_tokens=8, max_ngram=4, answers=answers)  # answer_tokens 0: off
    off.history = [1, 2, 3, 4, 5, 3, 30, 31]
    assert off.plain_step(root) is root
    d = LookupDrafter(head=None, max_tokens=8, max_ngram=4, answers=answers, answer_tokens=3)
    d.history = [1, 2, 3, 4, 5, 9, 2, 3]  # a 2-token own match (OWN_MATCH): the request's own text
    assert d.plain_step(root).tokens.tolist() == [7, 4, 5]
    d.history = [1, 2, 3, 4, 5, 3, 30, 31]  # no own match (31 is new): the answers' chain, capped
    t = d.plain_step(root)
    assert t.tokens.tolist() == [7, 32, 33, 34] and t.parents.tolist() == [-1, 0, 1, 2] and d.last_lookup == 3
    d.history = [1, 2, 3, 4, 5, 3, 99]  # the answers know nothing of 99: the 0-token own match, nothing
    assert d.plain_step(root) is root
    d.history = [1, 2, 3, 4, 5, 3]  # nor of 3: the own 1-token match ("3" was followed by 4)
    assert d.plain_step(root).tokens.tolist() == [7, 4]
    d.history = [1, 2, 3, 4, 5, 3, 30, 31]  # a pair verifies long own matches only: not the answers'
    assert d.plain_step(root, rows=2) is root
    assert d.extend(root, max_tokens=2) is root  # beside the head's drafts: the own text only


@pytest.mark.parametrize("preset", ["chain_adaptive", "tree"])
def test_answers_in_the_branch_keep_greedy_output_alone_and_in_a_batch(tiny_target, preset):
    """Tables of the target's own greedy answers (their drafts are accepted) and of random token runs
    (rejected): greedy output equals target greedy decoding either way, in plain steps (where the
    table drafts), drafting steps and a batch."""
    from tests.test_spec_batch import _drive
    from tests.test_spec_engine import MAX_NEW, PROMPTS, _ids, hf_greedy

    eos = SpecEngine(tiny_target, None, PRESETS["baseline"]).eos_ids
    refs = {p: hf_greedy(tiny_target, _ids(tiny_target, p), MAX_NEW, eos) for p in PROMPTS}
    g = torch.Generator().manual_seed(0)
    noise = [torch.randint(0, tiny_target.model.config.vocab_size, (40,), generator=g).tolist() for _ in range(8)]
    cfg = replace(PRESETS[preset], lookup_tokens=6, answer_tokens=4)
    max_new = [MAX_NEW if i % 2 == 0 else 5 for i in range(len(PROMPTS))]
    for answers, name in ((AnswerNgrams.build(refs.values()), "own"), (AnswerNgrams.build(noise), "noise")):
        engine = SpecEngine(tiny_target, random_draft(tiny_target, 64), cfg, answers=answers)
        drafted, chain = [], answers.chain
        answers.chain = lambda history, k: drafted.append(chain(history, k)) or drafted[-1]
        accepted = 0
        for p in PROMPTS:  # plain steps of a row alone (draft size 0) draft from the table
            out, stats = engine.generate(_ids(tiny_target, p), MAX_NEW, max_draft_tokens=0)
            assert out == refs[p], (preset, name, p)
            accepted += sum((k - 1) * v for k, v in stats["accept_hist"].items())
            assert engine.generate(_ids(tiny_target, p), MAX_NEW)[0] == refs[p], (preset, name, p)
        assert any(drafted) and (accepted > 0 or name == "noise")
        out = _drive(engine, [_ids(tiny_target, p) for p in PROMPTS], max_new)
        for i, p in enumerate(PROMPTS):
            assert out[i] == refs[p][:max_new[i]], (preset, name, i)
