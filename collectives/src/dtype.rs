//! Element types a collective can carry, and the [`Element`] trait that maps Rust types onto them.

use std::fmt;
use std::str::FromStr;

use crate::UnknownName;

wire_enum! {
    /// The data types of NCCL (`ncclDataType_t`), with nccl-tests' names.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub enum DataType {
        Int8 = 0 => "int8",
        Uint8 = 1 => "uint8",
        Int32 = 2 => "int32",
        Uint32 = 3 => "uint32",
        Int64 = 4 => "int64",
        Uint64 = 5 => "uint64",
        Float16 = 6 => "half",
        Float32 = 7 => "float",
        Float64 = 8 => "double",
        Bfloat16 = 9 => "bfloat16",
    }
    /// Every data type, in wire-code order.
    const ALL;
    /// nccl-tests' name for the type (`int8`, `half`, `float`, `bfloat16`, ...).
    fn name;
}

impl DataType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::Int8 | DataType::Uint8 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Uint64 | DataType::Float64 => 8,
        }
    }

    /// True for the floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::Float16 | DataType::Float32 | DataType::Float64 | DataType::Bfloat16
        )
    }
}

impl FromStr for DataType {
    type Err = UnknownName;

    /// Accepts nccl-tests' names and the usual aliases (`f32`, `float32`, `fp16`, `bf16`, ...).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = match s.to_ascii_lowercase().as_str() {
            "int8" | "i8" | "char" => DataType::Int8,
            "uint8" | "u8" => DataType::Uint8,
            "int32" | "i32" | "int" => DataType::Int32,
            "uint32" | "u32" => DataType::Uint32,
            "int64" | "i64" => DataType::Int64,
            "uint64" | "u64" => DataType::Uint64,
            "half" | "float16" | "f16" | "fp16" => DataType::Float16,
            "float" | "float32" | "f32" | "fp32" => DataType::Float32,
            "double" | "float64" | "f64" | "fp64" => DataType::Float64,
            "bfloat16" | "bf16" => DataType::Bfloat16,
            _ => {
                let expected =
                    "int8, uint8, int32, uint32, int64, uint64, half, float, double, bfloat16";
                return Err(UnknownName::new("data type", s, expected));
            }
        };
        Ok(t)
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that collectives can carry. Implemented for `i8, u8, i32, u32, i64, u64`,
/// [`half::f16`], [`half::bf16`], `f32` and `f64`; sealed so the list stays in step with
/// [`DataType`].
pub trait Element: bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + sealed::Sealed {
    /// The data type this Rust type stands for.
    const DTYPE: DataType;
    /// The nearest value of this type (`as` for integers: saturating, NaN to 0).
    fn from_f64(v: f64) -> Self;
    /// This value as `f64` (exact except for 64-bit integers beyond 2^53).
    fn to_f64(self) -> f64;
}

macro_rules! element {
    ($($t:ty => $d:ident, $from:expr, $to:expr);* $(;)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$d;
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            fn to_f64(self) -> f64 {
                $to(self)
            }
        }
    )*};
}

macro_rules! int_elements {
    ($($t:ty => $d:ident),*) => {
        element!($($t => $d, |v| v as $t, |x| x as f64);*);
    };
}

int_elements!(i8 => Int8, u8 => Uint8, i32 => Int32, u32 => Uint32, i64 => Int64, u64 => Uint64);

element! {
    f32 => Float32, |v| v as f32, |x| x as f64;
    f64 => Float64, |v| v, |x| x;
    half::f16 => Float16, half::f16::from_f64, half::f16::to_f64;
    half::bf16 => Bfloat16, half::bf16::from_f64, half::bf16::to_f64;
}

/// Evaluates `$body` with the type name `$T` standing for the Rust type of the data type
/// `$dtype` (an [`Element`]): the one place that turns a run-time [`DataType`] into a generic
/// call, e.g. `with_element!(dtype, |T| reduce_slice::<T>(a, b))`.
#[macro_export]
macro_rules! with_element {
    ($dtype:expr, |$T:ident| $body:expr) => {
        $crate::with_element!(@arms $dtype, $T, $body; Int8 i8, Uint8 u8, Int32 i32, Uint32 u32,
            Int64 i64, Uint64 u64, Float16 $crate::half::f16, Float32 f32, Float64 f64,
            Bfloat16 $crate::half::bf16)
    };
    (@arms $dtype:expr, $T:ident, $body:expr; $($variant:ident $ty:ty),*) => {
        match $dtype {
            $($crate::DataType::$variant => {
                type $T = $ty;
                $body
            })*
        }
    };
}

impl DataType {
    /// `v` as one element of this type, in memory order (see [`Element::from_f64`]).
    pub fn encode_f64(self, v: f64) -> Vec<u8> {
        with_element!(self, |T| bytemuck::bytes_of(&T::from_f64(v)).to_vec())
    }

    /// The first element of `bytes` as `f64`, or `None` when `bytes` is shorter than one.
    pub fn decode_f64(self, bytes: &[u8]) -> Option<f64> {
        let bytes = bytes.get(..self.size())?;
        Some(with_element!(self, |T| bytemuck::pod_read_unaligned::<T>(
            bytes
        )
        .to_f64()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes_match_rust() {
        for t in DataType::ALL {
            assert_eq!(t.name().parse::<DataType>().unwrap(), t);
            assert_eq!(DataType::from_code(t.code()), Some(t));
        }
        assert_eq!(DataType::Float16.size(), std::mem::size_of::<half::f16>());
        assert_eq!(<half::bf16 as Element>::DTYPE, DataType::Bfloat16);
        assert!("float128".parse::<DataType>().is_err());
        assert_eq!(DataType::from_code(10), None);
    }
}
