#!/usr/bin/env python3
"""Builds SimCSE text data from WordNet 3.0 (Debian package `wordnet-base`).

    scripts/data/build_wordnet_text.py [--wordnet DIR] [--out data/wordnet] [--sentences N]
                                  [--triplets N] [--heldout N] [--seed S]

Without --wordnet it runs `apt-get download wordnet-base` and `dpkg -x` into a temporary
folder (no root needed) and reads usr/share/wordnet/data.{noun,verb,adj,adv}. Standard
library only. Writes into --out:

  sentences.txt   glosses and example sentences, one per line (wiki1m_for_simcse.txt format)
  triplets.csv    sent0,sent1,hard_neg (nli_for_simcse.csv format): an example sentence of a
                  synset; that synset's gloss (positive); the gloss of a sibling synset (same
                  hypernym) as hard negative. These are NOT NLI pairs.
  retrieval.tsv   held-out synsets (disjoint from the two files above): synset, sentence,
                  gloss; one example sentence per synset. Retrieval: each sentence against all
                  held-out glosses.

The output depends only on the WordNet files and --seed (sorted input, seeded shuffles).
"""

import argparse
import csv
import os
import random
import re
import subprocess
import sys
import tempfile

POS_FILES = ["noun", "verb", "adj", "adv"]
QUOTED = re.compile(r'"([^"]+)"')


def parse_data_file(path):
    """Yields (synset id, words, hypernym ids, definition, examples) per synset line."""
    with open(path, encoding="latin-1") as f:
        for line in f:
            if line.startswith("  "):  # the licence header
                continue
            head, _, gloss = line.partition(" | ")
            fields = head.split()
            offset, ss_type = fields[0], fields[2]
            n_words = int(fields[3], 16)
            words = [fields[4 + 2 * i].replace("_", " ") for i in range(n_words)]
            k = 4 + 2 * n_words
            n_ptr = int(fields[k])
            hypernyms = []
            for i in range(n_ptr):
                sym, target, pos = fields[k + 1 + 4 * i], fields[k + 2 + 4 * i], fields[k + 3 + 4 * i]
                if sym in ("@", "@i"):
                    hypernyms.append(f"{pos}{target}")
            gloss = gloss.strip()
            examples = [e.strip() for e in QUOTED.findall(gloss) if len(e.split()) >= 3]
            definition = gloss.split('; "')[0].split(' "')[0].strip().rstrip(";").strip()
            pos = "a" if ss_type == "s" else ss_type
            yield f"{pos}{offset}", words, hypernyms, definition, examples


def clean(text):
    return " ".join(text.replace("\t", " ").split())


def fetch_wordnet(tmp):
    subprocess.run(["apt-get", "download", "wordnet-base"], cwd=tmp, check=True)
    deb = [f for f in os.listdir(tmp) if f.startswith("wordnet-base") and f.endswith(".deb")][0]
    subprocess.run(["dpkg", "-x", deb, "x"], cwd=tmp, check=True)
    return os.path.join(tmp, "x", "usr", "share", "wordnet")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wordnet", help="folder with data.noun, data.verb, data.adj, data.adv")
    ap.add_argument("--out", default="data/wordnet")
    ap.add_argument("--sentences", type=int, default=20000, help="sentences to write (0: all)")
    ap.add_argument("--triplets", type=int, default=10000, help="triplets to write (0: all)")
    ap.add_argument("--heldout", type=int, default=1000, help="held-out synsets for retrieval")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        wn = args.wordnet or fetch_wordnet(tmp)
        synsets = {}
        for pos in POS_FILES:
            for sid, words, hyper, definition, examples in parse_data_file(os.path.join(wn, f"data.{pos}")):
                synsets[sid] = (words, hyper, clean(definition), [clean(e) for e in examples])

    rng = random.Random(args.seed)
    ids = sorted(synsets)
    with_examples = [s for s in ids if synsets[s][3] and len(synsets[s][2].split()) >= 3]
    rng.shuffle(with_examples)
    heldout = sorted(with_examples[: args.heldout])
    held = set(heldout)

    children = {}
    for s in ids:
        for h in synsets[s][1]:
            children.setdefault(h, []).append(s)

    train_ids = [s for s in ids if s not in held]
    sentences = set()
    for s in train_ids:
        _, _, definition, examples = synsets[s]
        if len(definition.split()) >= 3:
            sentences.add(definition)
        sentences.update(examples)
    sentences = sorted(sentences)
    rng.shuffle(sentences)
    if args.sentences:
        sentences = sentences[: args.sentences]

    triplets = []
    for s in train_ids:
        _, hyper, definition, examples = synsets[s]
        siblings = sorted({c for h in hyper for c in children.get(h, []) if c != s and c not in held})
        siblings = [c for c in siblings if synsets[c][2] != definition and len(synsets[c][2].split()) >= 3]
        if not examples or not siblings or len(definition.split()) < 3:
            continue
        for e in examples:
            triplets.append((e, definition, synsets[rng.choice(siblings)][2]))
    rng.shuffle(triplets)
    if args.triplets:
        triplets = triplets[: args.triplets]

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sentences.txt"), "w", encoding="utf-8") as f:
        f.writelines(s + "\n" for s in sentences)
    with open(os.path.join(args.out, "triplets.csv"), "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["sent0", "sent1", "hard_neg"])
        w.writerows(triplets)
    with open(os.path.join(args.out, "retrieval.tsv"), "w", encoding="utf-8") as f:
        f.write("synset\tsentence\tgloss\n")
        for s in heldout:
            _, _, definition, examples = synsets[s]
            f.write(f"{s}\t{examples[0]}\t{definition}\n")
    print(
        f"{len(synsets)} synsets; wrote {len(sentences)} sentences, {len(triplets)} triplets, "
        f"{len(heldout)} held-out synsets into {args.out}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
