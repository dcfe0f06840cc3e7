mkdir -p $OUT/pk
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-liger/pydantic*.whl .whl-liger/annotated*.whl .whl-liger/typing_insp*.whl >/dev/null 2>&1
PYTHONPATH=/tmp/site:$PWD/src timeout 130 python3 -m protrain train --set sample_packing=true --set max_steps=8 --set memory.n_persist=0 --set memory.n_buffer=2 --set output_dir=/tmp/pk --set save_steps=1000 --set logging_steps=1 > $OUT/pk/packed-flex.log 2>&1; echo "packed smoke rc=$?"; grep -i "attention\|done\|Error\|step [0-9]" $OUT/pk/packed-flex.log | tail -12 | cut -c1-300
