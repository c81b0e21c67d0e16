#!/usr/bin/env bash
# Writes data/models/bert-small-random/ (git-ignored): a small BERT architecture (2 layers,
# hidden 128, 2 heads, feed-forward 512, 128 positions) with all-MiniLM-L6-v2's tokenizer
# and NO weights, for SimCSE from a random initialisation (model.pretrained: false):
#   scripts/data/get_minilm.sh && scripts/data/make_small_bert.sh
#   launch --nproc-per-node 2 train --config configs/simcse.yaml \
#     --set model.dir=data/models/bert-small-random --set model.pretrained=false \
#     --set model.pooling=cls_before_pooler --set optim.lr=5.0e-4
set -euo pipefail
cd "$(dirname "$0")/../.."
src=data/models/all-MiniLM-L6-v2
dest=data/models/bert-small-random
[[ -f $src/tokenizer.json ]] || { echo "error: $src/tokenizer.json is missing: run scripts/data/get_minilm.sh first" >&2; exit 1; }
mkdir -p "$dest"
for f in tokenizer.json vocab.txt tokenizer_config.json special_tokens_map.json; do
  [[ -f $src/$f ]] && cp "$src/$f" "$dest/"
done
cat > "$dest/config.json" <<'JSON'
{
  "architectures": ["BertModel"],
  "model_type": "bert",
  "vocab_size": 30522,
  "hidden_size": 128,
  "num_hidden_layers": 2,
  "num_attention_heads": 2,
  "intermediate_size": 512,
  "hidden_act": "gelu",
  "hidden_dropout_prob": 0.1,
  "attention_probs_dropout_prob": 0.1,
  "max_position_embeddings": 128,
  "type_vocab_size": 2,
  "layer_norm_eps": 1e-12,
  "initializer_range": 0.02,
  "pad_token_id": 0
}
JSON
echo "small random BERT architecture written to $dest"
