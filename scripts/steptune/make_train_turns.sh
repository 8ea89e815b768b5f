# The `dropless train` command itself (the tiny preset, 80 steps, no evaluation or checkpoint), before
# and after, in turns: BASE_SRC=<old checkout>/src bash scripts/steptune/make_train_turns.sh (docs/training_speed.md).
set -e
for r in 1 2; do for v in before after; do
  src=$PWD/src; [ $v = before ] && src=${BASE_SRC:?set BASE_SRC to a checkout of the old commit/src}
  d=/tmp/mt/$v-$r; rm -rf $d
  s=$(date +%s.%N)
  PYTHONPATH=$src ${PY:-.venv/bin/python} -m dropless.cli train --config tiny --run-dir $d --set train.steps=80 --set train.warmup_steps=10 --set train.eval_every=1000 --set train.ckpt_every=1000 --set train.eval_batches=1 --set log.progress=false --set log.plots=false --set log.tensorboard=false > /dev/null 2>&1
  e=$(date +%s.%N)
  python3 -c "import json;d=json.load(open('$d/summary.json'));print('$v round $r', 'tokens_per_s', round(d['tokens_per_s']), 'wall_s', round($e-$s,1))"
done; done
