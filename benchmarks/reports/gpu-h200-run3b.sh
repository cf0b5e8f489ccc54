rm -rf /tmp/site/typer* /tmp/site/annotated_doc*
source .device/setup.sh
echo "start $(date -u +%T)"
(EXTRAS_TESTS=tests/test_host_reads.py EXTRAS_TEST_S=1 source .device/extras.sh) &
GPU_CHECK_STEPS="2" timeout 150 bash ../shared/tools/gpu-check; cp $OUT/gpu-report.txt $OUT/gpu-report-2.txt
wait; cat $OUT/extras.txt
GPU_CHECK_STEPS="3 4" bash ../shared/tools/gpu-check
echo "end $(date -u +%T)"
