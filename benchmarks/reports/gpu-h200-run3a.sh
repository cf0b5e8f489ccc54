source .device/setup.sh
echo "start $(date -u +%T)"
(source .device/extras.sh) &
GPU_CHECK_STEPS="1 2" timeout 330 bash ../shared/tools/gpu-check
wait
echo "== extras (ran beside steps 1-2: their tok/s are disturbed)"; cat $OUT/extras.txt
echo "end $(date -u +%T)"
