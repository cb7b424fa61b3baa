//! The norms gradclip computes, as one table ([`crate::norm_table!`]): each row names a norm's
//! kind, its accumulator ([`crate::accum`]) and its two entry points (the norm kernel and the
//! per-tensor-norm kernel). The kernels' entries (`entry.rs`, GPU only), [`NormKind`] and its
//! combine kind ([`crate::combine::kind`]), the host's kernel names and launch choice and the
//! CPU backend's accumulator all come from it: a new norm is its accumulator, one row here and
//! the host's `NormType` (which parses a user's p).

/// Calls `$m! { [extra] rows }` (or `$m! { rows }` without `extra`) with the table's rows,
/// `Kind: accumulator, norm kernel, per-tensor kernel;`, in [`NormKind`]'s order.
#[macro_export]
macro_rules! norm_table {
    ($m:ident $(, $($extra:tt)*)?) => {
        $m! {
            $([$($extra)*])?
            L1: $crate::accum::L1, gradclip_norm_l1, gradclip_tensor_norms_l1;
            L2: $crate::accum::L2, gradclip_norm_l2, gradclip_tensor_norms_l2;
            Inf: $crate::accum::Inf, gradclip_norm_inf, gradclip_tensor_norms_inf;
            P: $crate::accum::PNorm, gradclip_norm_p, gradclip_tensor_norms_p;
        }
    };
}

macro_rules! norm_kinds {
    ($($k:ident: $acc:ty, $norm:ident, $tensor_norms:ident;)*) => {
        /// A norm of the table ([`crate::norm_table!`]); its discriminant is the combine kind
        /// the one-thread kernels take ([`crate::combine::kind`]).
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum NormKind {
            $(
                #[doc = concat!("The `", stringify!($norm), "` row.")]
                $k,
            )*
        }

        impl NormKind {
            /// Every kind, in table order.
            pub const ALL: &'static [NormKind] = &[$(NormKind::$k),*];

            /// The norm kernel's entry-point name.
            pub const fn norm_kernel(self) -> &'static str {
                match self {
                    $(NormKind::$k => stringify!($norm),)*
                }
            }

            /// The per-tensor-norm kernel's entry-point name.
            pub const fn tensor_norms_kernel(self) -> &'static str {
                match self {
                    $(NormKind::$k => stringify!($tensor_norms),)*
                }
            }
        }
    };
}

norm_table!(norm_kinds);
