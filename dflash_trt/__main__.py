from dflash_trt.cli import main

main()
