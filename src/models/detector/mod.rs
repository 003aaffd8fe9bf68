//! Object detectors, like the reference's `src/model/detector/`: YOLOv8 for ADetailer.

pub mod yolov8;
