// Integer codes of the loss settings, shared with Python (rl_kernel_core/loss_codes.py; a test
// checks the two agree).
#pragma once

enum KlCode : int { kK1 = 0, kAbs = 1, kK2 = 2, kK3 = 3 };
enum Agg : int { kTokenMean = 0, kSeqMeanTokenSum = 1, kSeqMeanTokenMean = 2, kSeqMeanTokenSumNorm = 3, kTokenSum = 4 };
enum EstimatorCode : int { kGrpo = 0, kDrGrpo = 1, kRloo = 2 };
