"""benchmarks/real_text.py: documents joined and cut without losing text, the BPE tokenizer the trainer loads, and
the loss curves of a run resumed in parts."""

import json
import math
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import real_text  # noqa: E402


def test_documents_join_small_texts_and_cut_a_big_one_at_blank_lines():
  small = [f"file {i}\nline two\n" for i in range(10)]  # ~17 bytes each
  entries = "".join(f"Entry{i} \\E\\, n.\n   Meaning {i}.\n\n" for i in range(200))  # one big dictionary file
  docs = real_text.documents(small + [entries], min_bytes=100)
  assert all(len(d) >= 100 for d in docs[:-1])  # only the last may be short
  joined = "\n\n".join(docs)
  for i in range(10):
    assert f"file {i}\nline two" in joined
  for i in range(200):  # every dictionary entry whole, in order
    assert f"Entry{i} \\E\\, n.\n   Meaning {i}." in joined
  assert joined.index("Entry199") > joined.index("Entry0") > joined.index("file 9")


def test_tokenizer_round_trips_and_loads_as_the_trainer_loads_it(tmp_path):
  from MaxText.data.tokenizers import load_tokenizer

  docs = [f"The {w} of the {v} is a {w} to the {v}. " * 20 for w in ("act", "art", "end") for v in ("king", "law")]
  tok = real_text.train_tokenizer(docs, 300, tmp_path / "tokenizer.json")
  assert tok.get_vocab_size() <= 300
  ours = load_tokenizer("huggingface", str(tmp_path / "tokenizer.json"))
  assert (ours.bos_id, ours.eos_id) == (tok.token_to_id("<s>"), tok.token_to_id("</s>"))
  ids = ours.encode(docs[0])
  assert tok.decode(ids) == docs[0] and len(ids) < len(docs[0]) / 2  # merges learnt, text kept exactly


def test_curves_take_the_last_logged_loss_of_each_step_and_compare_the_end(tmp_path):
  def run(name, losses):
    d = tmp_path / name
    d.mkdir()
    rows = [{"step": s, "ce_loss": v, "loss": v + 1} for s, v in losses]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f"{name}={d}"

  # "b" was resumed at step 5 after logging to step 7: the re-run steps 5-7 replace the first ones
  a = [(s, 10.0 - s / 10) for s in range(60)]
  b = [(s, 10.0 - s / 10 + 1.0) for s in range(8)] + [(s, (10.0 - s / 10) * 1.01) for s in range(5, 60)]
  stats = tmp_path / "stats.json"
  stats.write_text(json.dumps({"unigram_entropy_nats": 7.3}))
  real_text.main(["curves", "--out", str(tmp_path / "out"), "--stats", str(stats), run("a", a), run("b", b)])
  out = json.loads((tmp_path / "out" / "curves.json").read_text())
  assert out["unigram_entropy_nats"] == 7.3
  assert out["metric"] == "ce_loss" and out["runs"]["b"]["steps"] == list(range(60))
  assert out["runs"]["b"]["losses"][5:] == [v for _, v in b[8:]]  # the cross-entropy, not the total loss
  assert out["runs"]["a"]["last_20_gap_to_first"] == out["runs"]["a"]["last_50_gap_to_first"] == 0
  assert math.isclose(out["runs"]["b"]["last_20_gap_to_first"], 0.01, rel_tol=1e-9)
  assert math.isclose(out["runs"]["b"]["last_50_gap_to_first"], 0.01, rel_tol=1e-9)
  assert (tmp_path / "out" / "curves.png").stat().st_size > 0
