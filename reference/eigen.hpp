// Eigen aliases for row-major maps over contiguous (or strided) buffers of the reference.
#pragma once

#include <Eigen/Dense>

#include "config.hpp"

namespace m3::ref {

template <class S>
using Mat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class S>
using Vec = Eigen::Matrix<S, Eigen::Dynamic, 1>;
template <class S>
using MapM = Eigen::Map<Mat<S>>;
template <class S>
using CMapM = Eigen::Map<const Mat<S>>;
// A [rows, cols] block whose rows are `stride` elements apart (a head's slice of [BT, nh, hd]).
template <class S>
using SMapM = Eigen::Map<Mat<S>, 0, Eigen::OuterStride<>>;
template <class S>
using CSMapM = Eigen::Map<const Mat<S>, 0, Eigen::OuterStride<>>;
// A column of a [BT, nh] per-head scalar tensor: `stride` = nh.
template <class S>
using SVec = Eigen::Map<Vec<S>, 0, Eigen::InnerStride<>>;
template <class S>
using CSVec = Eigen::Map<const Vec<S>, 0, Eigen::InnerStride<>>;

}  // namespace m3::ref
